"""The run config's training sections: model, data, inner and outer optimizers, rounds, wire, streaming,
eval and checkpoints (diloco/config.py assembles them into a RunConfig and loads it from TOML)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ModelConfig:
    vocab_size: int = 64
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    # Grouped-query attention: key/value heads, each shared by n_heads // n_kv_heads query heads (0: n_heads).
    n_kv_heads: int = 0
    # The SwiGLU MLP's hidden size (three d_model x d_ff matrices): 344 keeps the demo at ~0.8M parameters.
    d_ff: int = 344
    max_seq_len: int = 128
    rope_theta: float = 10000.0
    init_std: float = 0.02
    # The output projection reuses the embedding matrix; false gives it its own (as Llama 2 7B).
    tie_embeddings: bool = True
    norm_eps: float = 1e-5
    # Mixture of experts (diloco/models/moe.py): 0 is the dense MLP; n >= 2 makes every block's MLP n SwiGLU
    # experts of d_ff each and a router. Each token takes moe_top_k of them; an expert takes at most
    # ceil(moe_capacity_factor * seq_len * top_k / n) tokens of a sequence (the rest skip it); the
    # training loss adds moe_aux_loss_coef times the load-balancing loss (1 at uniform routing).
    moe_experts: int = 0
    moe_top_k: int = 2
    moe_capacity_factor: float = 1.25
    moe_aux_loss_coef: float = 0.01

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


@dataclass
class DataConfig:
    # "synthetic": the embedded Markov language; "text": a byte-level text file; "tokens": a token
    # corpus at `url` (made by `diloco-data prepare`, or a MosaicML MDS dataset with a token column),
    # leased to islands so that every sample is trained on at most once an epoch.
    source: str = "synthetic"
    path: str = ""
    url: str = ""
    # Tokens: samples per shuffled block of the epoch order (diloco/data/samples.py).
    shuffle_block: int = 256
    # Tokens, local to each process (not part of the config digest): where shards are cached, how
    # many bytes of them, how many shards ahead to download in the background.
    cache_dir: str = ""
    cache_gb: float = 8.0
    prefetch_shards: int = 2
    seq_len: int = 128
    # Fraction of a text file held out (from its end) for evaluation.
    eval_fraction: float = 0.1
    # Disjoint training shards; the coordinator hands them out in join order.
    shards: int = 4
    # Text: shard s takes every shards-th stripe of this many bytes (i.i.d.
    # shards); 0 makes each shard one contiguous block of the file.
    stripe_bytes: int = 4096
    # Synthetic language: order-k Markov chain over `vocab` tokens in which each
    # context allows `branching` next tokens.
    synthetic_vocab: int = 64
    synthetic_order: int = 2
    synthetic_branching: int = 6
    synthetic_seed: int = 1234


@dataclass
class InnerConfig:
    # "adamw", "sgd", or "muon": Muon for the blocks' matrices, AdamW (lr, betas, weight_decay below)
    # for the embedding, output head and norm gains, as MuLoCo does (diloco/models/muon.py).
    optimizer: str = "adamw"
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    # "cosine" (warmup, then cosine to min_lr_ratio) or "constant".
    schedule: str = "cosine"
    betas: list[float] = field(default_factory=lambda: [0.9, 0.99])
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    batch_size: int = 8  # sequences per island per inner step
    steps_per_round: int = 20  # H
    # How many inner steps a round may hold when islands differ (diloco/pace.py): rounds.mode = "time"
    # runs as many as fit in rounds.round_s, at least min_steps and at most max_steps; an island's own
    # --steps-per-round may not exceed max_steps either. 0: steps_per_round. A push may claim at most
    # max(steps_per_round, max_steps) (+ streaming overlap) inner steps.
    min_steps: int = 1
    max_steps: int = 0
    # Muon's peak lr (0: lr), on the same warmup and cosine as AdamW's. With "match_rms_adamw" each
    # matrix's update is scaled by 0.2 * sqrt(max(rows, cols)) to AdamW's update RMS (Moonlight), so
    # AdamW's lr and weight decay carry over; "original" (Keller Jordan's sqrt(max(1, rows/cols)))
    # wants a lr near 0.02. Weight decay is weight_decay, decoupled as AdamW's.
    muon_lr: float = 0.0
    muon_adjust_lr: str = "match_rms_adamw"
    muon_momentum: float = 0.95  # Nesterov momentum on the gradient, before orthogonalizing
    muon_ns_steps: int = 5  # Newton-Schulz iterations (torch's quintic coefficients)


@dataclass
class OuterConfig:
    lr: float = 0.7
    momentum: float = 0.9
    nesterov: bool = True


@dataclass
class RoundConfig:
    rounds: int = 20
    min_islands: int = 1
    max_islands: int = 64
    # A round closes at its deadline if at least min_islands have pushed.
    deadline_s: float = 600.0
    heartbeat_s: float = 1.0
    # An island that has not heartbeated for this long leaves the run.
    lease_s: float = 10.0
    # The most ranks (replica groups x ranks per group) an island may declare at join where no certificate
    # says: without mutual TLS (plaintext serves loopback only: one machine's ranks) and with a certificate
    # issued before certificates carried ranks. A certificate's ranks (`diloco-certs island DIR NAME --ranks N`)
    # bound its island instead. 8: one machine of 8 accelerators. A push's tokens, and the island's stream and
    # heartbeat bounds, scale with ranks: this is the weight a caller without such a certificate can claim.
    max_island_ranks: int = 8
    # A certificate issued before certificates carried ranks is refused at join (it would be allowed
    # max_island_ranks, 8x a one-rank island's tokens); true lets such certificates join, capped at
    # max_island_ranks, for a run that must keep them until each is issued again with --ranks.
    allow_unranked_certificates: bool = False
    # "steps": every island trains inner.steps_per_round (H) inner steps a round (or its own
    # --steps-per-round); "time": each trains for round_s seconds of its own wall time from the start of
    # its round (less the time blocked on a result), between inner.min_steps and inner.max_steps steps, then
    # pushes with its token count, so fast islands do more steps instead of waiting (with fragments, one
    # clock per fragment; replica groups agree on it through their gradient all-reduce).
    mode: str = "steps"
    round_s: float = 0.0
    # Late contributions: a push that arrives up to late_rounds rounds after its round closed is folded
    # into the current round with weight tokens x late_discount ** staleness (staleness: rounds between
    # the round it trained for and the one it is folded into) instead of being refused; 0: refused. A round
    # does not wait for an island whose last contribution came late until it contributes on time again.
    late_rounds: int = 0
    late_discount: float = 0.5
    # "discount": late contributions join the round's mean and its one Nesterov step; "delayed_nesterov" (Liu et
    # al. 2024): they move the parameters momentum-free (same weights) and join the momentum a round later.
    late_mode: str = "discount"


@dataclass
class WireConfig:
    # Uplink (pseudo-gradient) codec: fp32, bf16, int8, e3m0 (4-bit) or topk.
    codec: str = "fp32"
    # Downlink (outer update) codec; "" means the same as codec. Lossy downlinks
    # keep error feedback on the coordinator so every copy stays bit-identical.
    downlink_codec: str = ""
    # Follow the codec with zstd.
    zstd: bool = False
    zstd_level: int = 3
    # Island-side error feedback on the uplink, for any codec.
    error_feedback: bool = False
    # Top-k keeps error feedback (SparseLoCo) unless this is false.
    topk_error_feedback: bool = True
    # e <- decay * e + pseudo_gradient before encoding (1.0: classic error feedback).
    # -1 (auto): 0.25 for topk, 1.0 for the others and with feedback_in_model (as measured).
    # Top-k's residual is mostly noise here (docs/benchmarks.md, Codec loss cost: at 15% density decay 1
    # cost +6.1%, 0.25 +1.8%).
    feedback_decay: float = -1.0
    # Keep the residual in the island's local parameters instead of adding it to the next
    # message: each round starts from theta_global - decay * residual (CSER's error reset).
    feedback_in_model: bool = False
    block_size: int = 256  # elements per scale block (int8, e3m0)
    topk_density: float = 0.02
    topk_block: int = 4096
    topk_bits: int = 2  # per kept value: a sign bit and bits-1 bits choosing one of 2^(bits-1) magnitude levels
    # Payload bytes per chunk; far under gRPC's 4 MB default message limit.
    chunk_bytes: int = 1 << 20
    # Compression per link (coordinator/links.py): islands may push with any of these codecs (and `codec`,
    # which they start with). Listed from the least lossy to the most: for each island and round the
    # coordinator advises the first whose push, at the island's measured throughput, takes at most
    # link_fraction of the round's time (rounds.round_s, or the last round's duration), else the last.
    # Pair a lossy one with error_feedback. Empty: every island pushes with `codec`.
    link_codecs: list[str] = field(default_factory=list)
    link_fraction: float = 0.1

    @property
    def uses_error_feedback(self) -> bool:
        """Islands keep an error-feedback buffer when asked to, and for top-k (with or without zstd)
        unless topk_error_feedback is false."""
        return self.error_feedback or (self._topk_uplink and self.topk_error_feedback)

    @property
    def decay(self) -> float:
        """The effective feedback_decay."""
        if self.feedback_decay != -1.0:
            return self.feedback_decay
        return 0.25 if self._topk_uplink and not self.feedback_in_model else 1.0

    @property
    def _topk_uplink(self) -> bool:
        return self.codec.partition("+")[0] == "topk"


@dataclass
class StreamingConfig:
    """Streaming DiLoCo: the model syncs in fragments, each at its own offset, overlapped with training.

    fragments = 1 with tau = 0 and alpha = 0 is plain DiLoCo (the default).
    """

    # P: the model splits into this many fragments of transformer blocks; each
    # syncs once every inner.steps_per_round steps at offset f * H // P.
    fragments: int = 1
    # "strided": block i belongs to fragment i % P; "sequential": P contiguous
    # groups of blocks. The embedding goes with block 0's fragment, every other
    # non-block parameter (the final norm, an untied lm_head) with the last block's.
    pattern: str = "strided"
    # Inner steps between a fragment's push and the step at which its result
    # is mixed in (the exchange runs in the background meanwhile); 0 blocks.
    # -1 (auto): 1 with fragments > 1, 0 with one fragment.
    tau: int = -1
    # Mixing at landing: theta_local = alpha * theta_local + (1 - alpha) * theta_global.
    alpha: float = 0.0
    # Eager updates: between push and landing the island trains from a
    # provisional global built from its own fresh pseudo-gradient and the
    # others' one-round-stale ones; the exact result replaces it on landing.
    eager: bool = False

    @property
    def overlap(self) -> int:
        """The effective tau."""
        if self.tau >= 0:
            return self.tau
        return 1 if self.fragments > 1 else 0


@dataclass
class EvalConfig:
    # Batches of held-out data the coordinator evaluates the global parameters
    # on after each round (0 disables evaluation).
    batches: int = 8
    batch_size: int = 16
    every_rounds: int = 1
    # Downstream tasks (diloco/models/evaluation.py make_task_evaluator): a HellaSwag-format JSON-lines
    # file (a path or fsspec URL) scored every tasks_every_rounds rounds (0: never); with
    # hellaswag_examples > 0 only its first that many (the validation set is 10,042 x 4 endings).
    hellaswag: str = ""
    hellaswag_examples: int = 0
    tasks_every_rounds: int = 0


@dataclass
class CheckpointConfig:
    # fsspec URL (local path or s3://bucket/prefix) for the coordinator's
    # checkpoints; empty disables them. Islands take --checkpoint on their CLI.
    url: str = ""
    every_rounds: int = 5
    keep_last: int = 3
