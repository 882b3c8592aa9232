"""What a kill costs a run on the defaults: Streaming DiLoCo with the claim check on.

Runs the embedded default (the demo's model, 4-bit + zstd both ways, mutual TLS,
robust aggregation with the claim check) with Streaming DiLoCo (P = 2
fragments, tau = 1), 2 islands, once undisturbed and once per kind of kill:

- island: one island SIGKILLed once a round has closed, restarted with --resume
  from its own checkpoint (every round);
- coordinator: the coordinator SIGKILLed two rounds after its last checkpoint
  (checkpoint.every_rounds = 4), so its islands are ahead of it when it is back;
- shard (against "sharded": the same run on a coordinator of 2 shards, `serve
  --shards 2`, undisturbed): the following shard SIGKILLed once it checkpointed
  a round; its launcher starts it again with --resume and it resumes at the round
  the leader is in;
- launcher (with --launcher, against "fsdp": the same layout undisturbed): island 1
  is a 2-rank FSDP island; its launcher (the
  `diloco-island join --nproc-per-node 2` process a user starts) is SIGKILLed and
  started again with --resume. Its ranks must die with it, or the island would
  run twice (a second copy is refused).

For each run it prints the pushes refused (by reason), the rounds that closed on
0 tokens, and each fragment's tokens folded against the undisturbed run's: what
a kill cost in work the coordinator never folded (the work since the last
checkpoint, and the rounds an island was down for).

With --tokens TEXT the islands train on a token corpus prepared from TEXT (a
BPE of 4,096 trained on it; e.g. ../shared/data/wikitext2-valid.txt) with the
coordinator's ledger on, and each row also gives the ledger's account: tokens
leased, lost (trained for a round that was then discarded, or leased and never
trained: the work a kill cost) and handed back untrained.

    python -m benchmarks.faults [--rounds 8] [--kinds none,island,coordinator,shard] [--launcher] [--tokens TEXT]

--launcher starts torchrun, whose store binds every interface: run it in a
network namespace with only loopback, as the tests do (README, results table).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from diloco.config import RunConfig, load_config
from islands.sim.simulation import Simulation

KINDS = ("none", "island", "coordinator", "sharded", "shard", "fsdp", "launcher")
# The undisturbed run of the same layout.
BASELINE = {"island": "none", "coordinator": "none", "shard": "sharded", "launcher": "fsdp"}


def config(rounds: int, kind: str, corpus: str = "") -> RunConfig:
    overrides = ["streaming.fragments=2", "streaming.tau=1", f"rounds.rounds={rounds}", "rounds.min_islands=2",
                 "data.shards=2", "rounds.heartbeat_s=0.5"]
    if corpus:  # the vocabulary from the corpus's manifest, as configs/wikitext.toml
        overrides += ["data.source=tokens", f"data.url={corpus!r}", "model.vocab_size=0"]
    # Checkpoints every round, except that the coordinator's kill lands two rounds after its last one.
    overrides.append(f"checkpoint.every_rounds={4 if kind == 'coordinator' else 1}")
    return load_config(None, overrides)


def prepare_corpus(text: str, out: Path) -> str:
    """TEXT tokenized with a BPE trained on it, into out (one shard in 256 for evaluation); returns its URL."""
    from diloco.data.prepare import PrepareConfig, prepare

    prepare(PrepareConfig([text], str(out), vocab_size=4096, eval_fraction=1 / 256, shard_tokens=1 << 16))
    return str(out)


def run(kind: str, rounds: int, workdir: Path, corpus: str = "", timeout_s: float = 900) -> dict:
    cfg = config(rounds, kind, corpus)
    island_args = {1: ["--nproc-per-node", "2"]} if kind in ("fsdp", "launcher") else None
    shards = 2 if kind in ("sharded", "shard") else 1
    sim = Simulation(cfg, 2, workdir, checkpoints=True, island_args=island_args, coordinator_shards=shards)
    kill_at = 5 if kind == "coordinator" else rounds // 2  # the coordinator's checkpoint holds rounds 0-3
    killed_at, closed = None, 0
    try:
        sim.start()
        for summary in sim.watch(timeout_s):
            closed += 1
            # A shard is killed once it checkpointed a step (every P fragment rounds): as many rounds closed as that.
            due = closed == kill_at * cfg.streaming.fragments if kind == "shard" else summary.fragment == 0 and summary.round == kill_at
            if kind in BASELINE and killed_at is None and due:
                killed_at = time.monotonic()
                if kind == "coordinator":
                    sim.kill_coordinator()
                    sim.start_coordinator(resume=True)
                elif kind == "shard":
                    sim.kill_coordinator_shard(1, after_step=closed)
                else:
                    sim.kill_island(1)  # the launcher, for an FSDP island: its ranks die with it
                    sim.start_island(1, resume=True)
        result = sim.finish(timeout_s)
    finally:
        sim.close()
    if kind in BASELINE and killed_at is None:
        raise RuntimeError(f"{kind}: the run ended before its kill was due (round {kill_at}); give it more --rounds")
    report = result.report
    folded = {f: sum(r["tokens"] for r in report["rounds"] if r["fragment"] == f) for f in range(cfg.streaming.fragments)}
    return {
        "kind": kind, "seconds": result.seconds, "refusals": report["events"]["refusals"],
        "zero_token_rounds": sum(1 for r in report["rounds"] if r["tokens"] == 0),
        "rounds": len(report["rounds"]), "folded": folded, "checksums_agree": set(report["islands"].values()) == {report["checksum"]},
        "eval_loss": report["rounds"][-1]["eval_loss"], "data": report.get("data"),
    }


def main() -> None:
    p = argparse.ArgumentParser(prog="faults", description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--kinds", default="none,island,coordinator", help=f"comma-separated, of {', '.join(KINDS)}")
    p.add_argument("--launcher", action="store_true", help="also kill an FSDP island's launcher (starts torchrun)")
    p.add_argument("--json", metavar="OUT", help="also write the rows as JSON")
    p.add_argument("--tokens", metavar="TEXT", help="train on a token corpus prepared from this text file, ledger on")
    args = p.parse_args()
    kinds = [k for k in args.kinds.split(",") if k] + (["launcher"] if args.launcher else [])
    if args.rounds < 8 or any(k not in KINDS for k in kinds):
        p.error(f"--rounds must be at least 8 and --kinds of {', '.join(KINDS)}")
    kinds = [b for b in ("none", "sharded", "fsdp") if b in kinds or any(BASELINE.get(k) == b for k in kinds)] + \
            [k for k in kinds if k in BASELINE]
    rows = {}
    if args.tokens and not Path(args.tokens).is_file():
        p.error(f"--tokens {args.tokens}: no such file")
    with tempfile.TemporaryDirectory(prefix="diloco-faults-") as work:
        corpus = prepare_corpus(args.tokens, Path(work) / "tokens") if args.tokens else ""
        for kind in kinds:
            rows[kind] = run(kind, args.rounds, Path(work) / kind, corpus)
    print(f"{'kill':<12} {'refused':<28} {'0-token rounds':>14} {'tokens folded per fragment (vs undisturbed)':>46} {'eval':>7} {'agree':>6} {'secs':>6}")
    for kind, row in rows.items():
        base = rows[BASELINE.get(kind, kind)]["folded"]
        lost = ", ".join(f"f{f} {n:,} ({100 * (n - base[f]) / base[f]:+.1f}%)" for f, n in row["folded"].items())
        print(f"{kind:<12} {json.dumps(row['refusals']):<28} {row['zero_token_rounds']:>14} {lost:>46} "
              f"{row['eval_loss']:>7.4f} {str(row['checksums_agree']):>6} {row['seconds']:>6.1f}")
    if args.tokens:
        print(f"\n{'kill':<12} {'tokens leased':>14} {'lost':>10} {'lost %':>7} {'handed back':>12} {'trained twice':>14}")
        for kind, row in rows.items():
            d = row["data"]
            print(f"{kind:<12} {d['tokens_leased']:>14,} {d['tokens_lost']:>10,} {100 * d['tokens_lost'] / d['tokens_leased']:>6.2f}% "
                  f"{d['tokens_returned']:>12,} {d['tokens_repeated']:>14,}")
    if args.json:
        Path(args.json).write_text(json.dumps(list(rows.values()), indent=1))


if __name__ == "__main__":
    main()
