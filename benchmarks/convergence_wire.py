"""The convergence benchmark's wire: pseudo-gradients and updates through the deployed codecs.

Split from benchmarks/convergence.py (which runs the jobs) to keep each file short.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from coordinator.publish import Publication  # the coordinator's own downlink arithmetic
from diloco import aggregate
from diloco.wire.codec import Codec, get_codec
from diloco.config import ConfigError, RunConfig
from diloco.wire.feedback import ErrorFeedback
from diloco.outer import OuterOptimizer, PseudoGradientAccumulator
from diloco.robust import NormGuard, Sketcher, add_exact, cosines
from diloco.v1 import diloco_pb2 as pb
from diloco.wire.messages import Manifest, downlink_codec, tensor_chunks, uplink_codec, verify_and_decode


@dataclass
class Push:
    """An island's pseudo-gradient as the coordinator holds it at the close (a diloco.aggregate.Contribution): its
    chunks as sent, and their sum of squares and sketch, made as they arrived."""

    tokens: int
    lr_sum: float
    chunks_sent: list[pb.TensorChunk] = field(default_factory=list)
    sumsq_parts: list[float] = field(default_factory=list)
    sketch: np.ndarray | None = None
    sketched: bool = True
    staleness: int = 0  # the benchmark's islands are never late
    origin: int = 0

    @property
    def sumsq(self) -> float:
        return math.fsum(self.sumsq_parts)

    @property
    def weight(self) -> int:
        return self.tokens

    def chunks(self, codec: Codec) -> list[aggregate.ChunkToFold]:
        return [aggregate.ChunkToFold(chunk, codec, stable=True) for chunk in self.chunks_sent]

    def release(self) -> None:
        self.chunks_sent = []


class Wire:
    """The coordinator's and islands' arithmetic for one round trip through the codecs.

    Uplink: each island's pseudo-gradient goes through `tensor_chunks` (with the
    island's error feedback where the config asks for it) and is taken in as the
    coordinator takes a push in (each chunk's sum of squares and sketch). The round:
    diloco.aggregate's judge, fold and outer step, the coordinator's own.
    Downlink: `coordinator.publish.Publication` compresses the update and keeps
    its error feedback; islands hold its published parameters. With fp32 both
    ways this is bit for bit the uncompressed arithmetic.
    """

    def __init__(self, cfg: RunConfig, outer_params: dict[str, torch.Tensor], islands: int):
        self.cfg = cfg
        self.codec = uplink_codec(cfg.wire)
        self.manifest = Manifest.of(outer_params)
        shapes = self.manifest.shapes
        self.feedback = [ErrorFeedback(shapes, cfg.wire.decay, cfg.wire.feedback_in_model) if cfg.wire.uses_error_feedback else None
                         for _ in range(islands)]
        self.outer = OuterOptimizer(outer_params, cfg.outer)
        self.accumulator = PseudoGradientAccumulator(shapes)
        self.guard = NormGuard(cfg.robust)  # the coordinator's robust aggregation (robust.enabled, on by default)
        self.publication = Publication(outer_params, downlink_codec(cfg.wire), cfg.wire.chunk_bytes)
        self.bytes_up = self.bytes_down = 0
        self.sketcher = Sketcher(b"convergence")  # the guard's direction check, as the coordinator sketches at intake
        self.least_cosine = math.inf  # the lowest cosine between two islands' pushes of a round, over the run

    def push(self, island: int, pg: dict[str, torch.Tensor], tokens: int, lr_sum: float) -> Push:
        """The island's pseudo-gradient, trained on `tokens` with inner lrs summing to lr_sum, as the coordinator
        receives it (FragmentRounds.receive): each chunk's sum of squares (add_exact) and sketch."""
        pushed = Push(tokens, lr_sum, sketch=self.sketcher.empty())
        for chunk in tensor_chunks(pg, self.codec, self.cfg.wire.chunk_bytes, feedback=self.feedback[island]):
            self.bytes_up += pb.PushMessage(chunk=chunk).ByteSize()
            sumsq, values = verify_and_decode(chunk, self.manifest, self.codec, chunk.payload)
            add_exact(pushed.sumsq_parts, sumsq)
            self.sketcher.add(pushed.sketch, chunk.name, chunk.offset, values.numpy())
            pushed.chunks_sent.append(chunk)
        return pushed

    def round(self, pushes: list[Push], islands: int) -> int:
        """As coordinator/rounds.py applies a round (FragmentRounds.apply): the guard's verdict, the fold in island
        order, the outer step and the publication. Returns how many contributions were clipped or dropped."""
        keyed = [(str(i), p) for i, p in enumerate(pushes)]
        self.least_cosine = min([self.least_cosine, *cosines({k: p.sketch for k, p in keyed if p.sketch is not None}).values()])
        verdict = aggregate.judge(self.guard, keyed)
        aggregate.fold(self.accumulator, self.codec, keyed, verdict, self.manifest.total_numel())
        if aggregate.takes_step(aggregate.kept(keyed, verdict)):
            aggregate.outer_step(self.outer, self.accumulator)
            self.publication.publish()
        else:
            self.publication.unchanged()
        self.accumulator.reset()
        self.bytes_down += islands * self._sent_down()
        return len(verdict.clipped) + len(verdict.dropped)

    def _sent_down(self) -> int:
        """What one island pulls: the update's chunks (a lossy downlink), else the values."""
        return sum(pb.ResultMessage(chunk=c).ByteSize() for c in self.publication.delta_chunks) or sum(
            pb.ResultMessage(chunk=c).ByteSize() for c in tensor_chunks(self.publication.params, self.publication.codec, self.cfg.wire.chunk_bytes)
        )


CODEC_FLAGS = (
    "@ef (error feedback on the islands), @noef (top-k without error feedback), @dDENSITY (top-k density, e.g. @d0.05), "
    "@bBITS (top-k value bits), @decayD (error-feedback decay), @carry (error feedback kept in the model), "
    "@lrLR and @mMOMENTUM (outer optimizer), @sgd (outer lr 1, no momentum, as SparseLoCo) and @muon (Muon as the "
    "inner optimizer, inner.muon_* from --set)"
)


def apply_codec_spec(cfg: RunConfig, spec: str) -> None:
    """Sets cfg for "UP[/DOWN][@FLAG...]"; raises ValueError naming a bad flag or codec."""
    codecs, *flags = spec.split("@")
    up, _, down = codecs.partition("/")
    cfg.wire.codec, cfg.wire.downlink_codec = up, down or up
    for flag in flags:
        number = flag.lstrip("abcdefghijklmnopqrstuvwxyz")
        name = flag[: len(flag) - len(number)]
        try:
            if (name, number) == ("ef", ""):
                cfg.wire.error_feedback = True
            elif (name, number) == ("noef", ""):
                cfg.wire.topk_error_feedback = False
            elif (name, number) == ("carry", ""):
                cfg.wire.feedback_in_model = True
            elif (name, number) == ("sgd", ""):  # SparseLoCo: error feedback stands in for outer momentum
                cfg.outer.lr, cfg.outer.momentum = 1.0, 0.0
            elif (name, number) == ("muon", ""):  # MuLoCo: a per-method inner optimizer, against AdamW in one table
                cfg.inner.optimizer = "muon"
            elif name == "decay":
                cfg.wire.feedback_decay = float(number)
            elif name == "d":
                cfg.wire.topk_density = float(number)
            elif name == "b":
                cfg.wire.topk_bits = int(number)
            elif name == "lr":
                cfg.outer.lr = float(number)
            elif name == "m":
                cfg.outer.momentum = float(number)
            else:
                raise ValueError
        except ValueError:
            raise ValueError(f"bad suffix @{flag}; suffixes are {CODEC_FLAGS}") from None
    try:
        for name in (up, down or up):
            get_codec(name, density=cfg.wire.topk_density, topk_bits=cfg.wire.topk_bits)
        cfg.validate()
    except ConfigError as e:
        raise ValueError(str(e)) from None
