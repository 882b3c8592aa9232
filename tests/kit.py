"""What several test modules share beyond conftest.py's fixtures: no tests here, and no test module imports another.

- The fake clock and the coordinator's round state machine driven by hand (CoordinatorState.receive and FragmentRounds.step,
  no gRPC): tests/test_rounds.py, test_fold_ahead.py, test_spool.py, test_heterogeneous.py, test_late_modes.py,
  test_time_rounds.py.
- Real islands on threads of this process against an in-process coordinator: test_heterogeneous.py,
  test_late_modes.py, test_resync.py, test_time_rounds.py.
- A coordinator checkpoint and diloco-export's command line: test_export.py, test_moe.py.
- Sharded islands' reports checked against the coordinator: test_fsdp_islands.py, test_moe.py.
- A small token corpus: test_token_runs.py, test_fsdp_islands.py.
- A command's stderr read line by line while it runs (StderrLines): test_cli.py.

Imported as `from kit import ...`, like conftest (pytest puts tests/ on sys.path).
"""

from __future__ import annotations

import json
import random
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from conftest import claim, ended, one_island_config, random_like, tiny_config, trained_from, wait_for_round
from coordinator import durable
from coordinator.server import initial_parameters
from coordinator.state import CoordinatorState
from diloco.checkpoint import CheckpointStore
from diloco.wire.codec import Fp32Codec
from diloco.cli.export import main as export_main
from diloco.data.prepare import PrepareConfig, prepare
from diloco.wire.refusal import Refused
from diloco.v1 import diloco_pb2 as pb
from diloco.v1 import diloco_pb2_grpc as pb_grpc
from diloco.wire.messages import PROTOCOL_VERSION, Manifest, tensor_chunks, uplink_codec
from islands.client import CoordinatorClient, ReplayableChunks
from islands.sharded import ShardedClient
from islands.island import Island
from islands.state import ReplicaSpec
from islands.world import IslandWorld


# --- the fake clock and the round state machine by hand ------------------------------------------


class Clock:
    """The one fake clock: whatever takes a clock (CoordinatorState, Membership, TokenBucket, RoundPace) calls it for the
    time; a test moves it with clock.now += seconds."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def make_state(tmp_path, *overrides: str, clock: Clock | None = None) -> CoordinatorState:
    """A CoordinatorState on tiny_config(*overrides) with its own spool folder under tmp_path, on clock (a fresh Clock
    if none)."""
    cfg = tiny_config(*overrides)
    spool = tmp_path / f"spool-{len(list(tmp_path.iterdir()))}"
    spool.mkdir()
    return CoordinatorState(cfg, initial_parameters(cfg), spool, clock=clock or Clock())


# The Nesterov outer step the state-machine tests check the aggregate with (make_state(tmp_path, *NESTEROV, ...)).
NESTEROV = ("outer.lr=0.7", "outer.momentum=0.9")


def refusal(call) -> pb.Refusal:
    """The typed refusal that call() raises."""
    with pytest.raises(Refused) as err:
        call()
    return err.value.refusal


def push(state: CoordinatorState, island_id: str, pg: dict[str, torch.Tensor], steps: int = 1, round_: int = 0,
         ranks: int = 1):
    """island_id's push for round_, claiming what `steps` inner steps on `ranks` ranks train (it joined with them)."""
    codec = uplink_codec(state.cfg.wire)
    header = pb.PushHeader(island_id=island_id, round=round_, train_loss=2.0, codec=codec.name, **claim(state.cfg, steps, ranks),
                           global_checksum=trained_from(state, round_))
    return state.receive(header, tensor_chunks(pg, codec, state.cfg.wire.chunk_bytes))


def push_tokens(state, island_id: str, pg: dict[str, torch.Tensor], tokens: int, round_: int, checksum: str | None = None,
                steps: int = 2, chunks: slice = slice(None), codec=None) -> pb.PushResponse:
    """island_id's push for round_ claiming `tokens` in `steps` inner steps, trained from the parameters of checksum (None:
    those round_ started from); only the `chunks` slice of its chunks is sent, in `codec` (None: the run's uplink)."""
    codec = codec or uplink_codec(state.cfg.wire)
    header = pb.PushHeader(island_id=island_id, round=round_, tokens=tokens, train_loss=2.0, codec=codec.name,
                           global_checksum=trained_from(state, round_) if checksum is None else checksum, inner_steps=steps)
    return state.receive(header, iter(list(tensor_chunks(pg, codec, state.cfg.wire.chunk_bytes))[chunks]))


# Three islands of unequal weight, as (inner steps, ranks declared at join): 128, 256 and 384 tokens in tiny_config.
# The same one inner step each: the norm guard judges norms per unit of inner lr, and these pseudo-gradients are alike.
SHARES = {"island-0": (1, 1), "island-1": (1, 2), "island-2": (1, 3)}


def join_shares(state: CoordinatorState) -> None:
    """Joins island-0, -1 and -2 in order, each declaring its SHARES ranks."""
    for island_id, (_, ranks) in SHARES.items():
        assert state.join("test", ranks=ranks).island_id == island_id


def push_share(state: CoordinatorState, island_id: str, pg: dict[str, torch.Tensor], round_: int):
    steps, ranks = SHARES[island_id]
    return push(state, island_id, pg, steps, round_, ranks)


def share_tokens(state: CoordinatorState) -> int:
    """The tokens of a round of all three SHARES islands."""
    return sum(claim(state.cfg, *share)["tokens"] for share in SHARES.values())


# The state-machine tests weigh islands in multiples of T, a full round's tokens on one rank (push_tokens's default 2 inner
# steps of tiny_config's 4 x 32 tokens: 256); their islands join declaring RANKS ranks, so that a push claiming up to
# RANKS x T in those 2 steps is an honest claim (robust.check_claims is on).
T = claim(tiny_config(), 2)["tokens"]
RANKS = 4


def join_all(state, hostnames: str) -> list[str]:
    """An island per hostname, each declaring RANKS ranks."""
    return [state.join(h, ranks=RANKS).island_id for h in hostnames]


class Reference:
    """The coordinator's arithmetic written out: the weighted mean as the accumulator forms it (each contribution
    scaled by its weight over the first one's, then divided by the total over the first), and torch's Nesterov SGD."""

    def __init__(self, cfg):
        self.params = {n: t.clone() for n, t in initial_parameters(cfg).items()}
        self.opt = torch.optim.SGD(list(self.params.values()), lr=cfg.outer.lr, momentum=cfg.outer.momentum, nesterov=True)

    def round(self, contributions: list[tuple[float, dict[str, torch.Tensor]]]) -> None:
        first = contributions[0][0]
        for name, p in self.params.items():
            mean = torch.zeros_like(p)
            for weight, pg in contributions:
                mean.add_(pg[name], alpha=weight / first)
            total = sum(w for w, _ in contributions) / first
            if total != 1.0:
                mean.div_(total)
            p.grad = mean
        self.opt.step()

    def matches(self, state) -> bool:
        return all(torch.equal(state.params[n], t) for n, t in self.params.items())


# --- real islands on threads of this process ----------------------------------------------------


class Puppet:
    """A second island driven by the test: it pushes a zero pseudo-gradient (H steps' tokens) when told."""

    def __init__(self, port: int, cfg):
        self.client = CoordinatorClient(f"127.0.0.1:{port}", connect_timeout_s=10)
        joined = self.client.join(cfg.digest(), "fp32")
        self.island_id, self.cfg, self.manifest = joined.island_id, cfg, Manifest.from_proto(joined.parameters)
        self.zeros = {n: torch.zeros_like(t) for n, t in initial_parameters(cfg).items()}

    def push(self, round_: int) -> None:
        """A zero push for round_ (the current round), naming the parameters it was trained from."""
        h = self.cfg.inner.steps_per_round
        fetched = self.client.fetch(self.island_id, {n: torch.zeros_like(t) for n, t in self.zeros.items()}, self.manifest)
        header = pb.PushHeader(island_id=self.island_id, round=round_, tokens=h * self.cfg.inner.batch_size * self.cfg.data.seq_len,
                               train_loss=0.0, codec="fp32", inner_steps=h,
                               global_checksum=fetched.fragments[0].checksum if fetched.fragments else fetched.checksum)
        self.client.push(header, ReplayableChunks(tensor_chunks(self.zeros, Fp32Codec(), self.cfg.wire.chunk_bytes)))

    def close(self) -> None:
        self.client.leave(self.island_id, "", 0)
        self.client.close()


class StderrLines:
    """A command started with its stderr read line by line on a thread, so that a test waits for the lines it
    expects while the command runs; the command is killed (and waited for) on close."""

    def __init__(self, argv: list[str]):
        import subprocess

        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        self._cond = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            with self._cond:
                self.lines.append(line.rstrip("\n"))
                self._cond.notify_all()
        with self._cond:
            self.lines.append(None)  # the end
            self._cond.notify_all()

    def wait_for(self, text: str, timeout_s: float = 120.0) -> str:
        """The first line containing text, once it came; fails if the command ends or timeout_s passes first."""
        def found() -> list[str | None] | None:  # [the line], [None] when the command ended first
            return next(([line] for line in self.lines if line is None or text in line), None)

        with self._cond:
            line = (self._cond.wait_for(found, timeout_s) or [None])[0]
        assert line is not None, f"no line with {text!r} (within {timeout_s:.0f}s, before it ended):\n" + self.text()
        return line

    def text(self) -> str:
        return "\n".join(line for line in self.lines if line is not None)

    def exit_code(self, timeout_s: float = 120.0) -> int:
        """The command's exit status, once it ended by itself."""
        return self.proc.wait(timeout_s)

    def close(self, timeout_s: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.kill()
        code = self.proc.wait(timeout_s)
        self._reader.join(timeout_s)
        return code

    def __enter__(self) -> StderrLines:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def wait_for(state, what: str, condition, timeout_s: float = 120.0) -> None:
    """Waits on the coordinator state's condition until condition() holds (at most timeout_s)."""
    with state.cond:
        assert state.cond.wait_for(condition, timeout_s), f"gave up waiting for {what}"


@contextmanager
def islands_on_threads(coordinator, cfg, specs: list[ReplicaSpec], gates: dict[int, threading.Event] | None = None):
    """Islands of these specs on threads: all joined first (so all in round 0), then run; a push for a round in gates
    waits for its event. Yields the islands and their results (filled as they finish); on leaving, every island has
    finished (or the gates are opened, and every thread is given up to 300 s), and its client is closed.
    coordinator: one, or a list of a sharded coordinator's shards (leader first): the islands then join it as
    islands/launch.py does, through a ShardedClient."""
    world = IslandWorld.init("cpu")
    clients, islands, results, errors, threads = [], [], {}, [], []

    def connect(address: str) -> CoordinatorClient:
        return CoordinatorClient(address, connect_timeout_s=10)

    try:
        for spec in specs:
            if isinstance(coordinator, list):
                client = ShardedClient(connect(f"127.0.0.1:{coordinator[0].port}"), connect)
            else:
                client = connect(f"127.0.0.1:{coordinator.port}")
            clients.append(client)
            islands.append(Island(cfg, world, client, client.join(cfg.digest(), uplink_codec(cfg.wire).name), spec))
            real = client.push

            def held(header, chunks, real=real):
                if gates and header.round in gates:
                    assert gates[header.round].wait(300), "the test never released the push"
                return real(header, chunks)

            client.push = held

        def one(i: int) -> None:
            try:
                results[i] = islands[i].run()
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(islands))]
        for t in threads:
            t.start()
        yield islands, results
        for t in threads:
            t.join(300)
        assert not errors, errors
        assert not any(t.is_alive() for t in threads), "an island did not finish"
    finally:
        for gate in (gates or {}).values():
            gate.set()
        if any(t.is_alive() for t in threads):  # the test failed: closed channels end the islands' calls at once
            for client in clients:
                client.close()
            for t in threads:
                t.join(60)
        for client in clients:
            client.close()
        world.shutdown()


def late_island_run(make_coordinator, *overrides: str):
    """A real island beside a puppet, k = 1: its round-0 push is held until round 0 closed without it (folded late into
    round 1), its round-2 push until round 4 is open (refused). Returns (state, puppet's id, the island, its result)."""
    # robust.first_quorum 1: round 0 must close with the puppet alone, the island's push held back.
    cfg = tiny_config("rounds.rounds=5", "rounds.late_rounds=1", "rounds.late_discount=0.5", "rounds.deadline_s=120",
                      "rounds.lease_s=600", "robust.first_quorum=1", *overrides)
    coordinator = make_coordinator(cfg)
    puppet = Puppet(coordinator.port, cfg)
    gates = {0: threading.Event(), 2: threading.Event()}
    try:
        with islands_on_threads(coordinator, cfg, [ReplicaSpec()], gates) as ((island,), results):
            _drive_late_island(coordinator.state, puppet, island, gates)
    finally:
        puppet.close()
    return coordinator.state, puppet.island_id, island, results[0]


def _drive_late_island(state, puppet: Puppet, island: Island, gates: dict[int, threading.Event]) -> None:
    """late_island_run's rounds, closed by the puppet (alone at a deadline of 0 where the island must miss one)."""
    def contributed(round_: int) -> bool:
        c = state.fragments[0].contributions.get(island.island_id)
        return state.round == round_ and c is not None and c.state == "complete"

    def close_without_the_island(round_: int) -> None:
        puppet.push(round_)
        state.cfg.rounds.deadline_s = 0.0  # this round only: it closes with the puppet alone
        wait_for(state, f"round {round_} to close", lambda: state.round > round_)
        state.cfg.rounds.deadline_s = 120.0

    close_without_the_island(0)
    gates[0].set()
    wait_for(state, "the island's round-1 contribution", lambda: contributed(1))
    assert (island.island_id, 0) in state.fragments[0].late.held, "the late push was not kept for round 1"
    puppet.push(1)
    wait_for(state, "round 1 to close", lambda: state.round > 1)
    close_without_the_island(2)
    close_without_the_island(3)
    gates[2].set()
    wait_for(state, "the island's round-4 contribution", lambda: contributed(4))
    puppet.push(4)


# --- a coordinator checkpoint and diloco-export's command line ----------------------------------


def coordinator_checkpoint(make_coordinator, url: str, *overrides: str, push: bool = True):
    """A coordinator checkpoint written as a run writes it: after a round closed on a made-up pseudo-gradient
    (checkpoint.every_rounds=1), or, without push, by durable.save at round 0. Returns (cfg, published params)."""
    cfg = one_island_config("rounds.rounds=3", f"checkpoint.url={url!r}", "checkpoint.every_rounds=1", "eval.batches=2", *overrides)
    coordinator = make_coordinator(cfg)
    store = CheckpointStore(url)
    if not push:
        durable.save(coordinator.state, store)
    else:
        import grpc

        with grpc.insecure_channel(f"127.0.0.1:{coordinator.port}") as channel:
            stub = pb_grpc.CoordinatorStub(channel)
            island = stub.Join(pb.JoinRequest(protocol_version=PROTOCOL_VERSION), timeout=5).island_id
            pg = random_like(coordinator.state.manifest.shapes, seed=1, scale=0.05)
            header = pb.PushHeader(island_id=island, round=0, codec="fp32", **claim(cfg), global_checksum=trained_from(coordinator))
            messages = [pb.PushMessage(header=header)]
            messages += [pb.PushMessage(chunk=c) for c in tensor_chunks(pg, Fp32Codec(), cfg.wire.chunk_bytes)]
            stub.PushPseudoGradient(ended(messages), timeout=10)
            wait_for_round(coordinator, 0)
        deadline = time.monotonic() + 20
        while store.latest() != 1:
            assert time.monotonic() < deadline, "the coordinator wrote no checkpoint after round 0"
            time.sleep(0.05)
    published = {n: t.clone() for n, t in coordinator.state.params.items()}
    return cfg, published


def export_cli(*args: str) -> int:
    return export_main([*map(str, args)])


def one_error_line(capsys, code: int) -> str:
    """diloco-export's one-line error (exit code 2), read from stderr."""
    assert code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("diloco-export: error: "), lines
    return lines[0]


# --- sharded islands' reports against the coordinator -------------------------------------------


def assemble_shards(reports: Path, group: int, attempt: int, world_size: int, key: str = "model") -> dict[str, torch.Tensor]:
    """One group's full parameters, put together from its ranks' final shards (only here, in the test)."""
    parts: dict[str, list[tuple[int, torch.Tensor]]] = {}
    for rank in range(world_size):
        tag = f"g{group}-r{rank}-a{attempt}"
        shards = torch.load(reports / f"{tag}.pt")[key]
        for name, offset, numel in json.loads((reports / f"{tag}.json").read_text())["ranges"]:
            parts.setdefault(name, []).append((offset, shards[name]))
            assert shards[name].numel() == numel
    return {name: torch.cat([t for _, t in sorted(pieces, key=lambda p: p[0])]) for name, pieces in parts.items()}


def assert_equals_coordinator(full: dict[str, torch.Tensor], coordinator: dict[str, torch.Tensor], what: str) -> None:
    assert set(full) == set(coordinator), what
    for name, t in coordinator.items():
        assert torch.equal(full[name], t.reshape(-1)), f"{what}: {name} differs from the coordinator's global parameters"


def assert_every_round_whole(result: dict, islands: int) -> None:
    """Every round of a scenario's result had all its islands and folded every element."""
    for r in result["rounds"]:
        assert len(r["islands"]) == islands, r
        assert r["elements_folded"] == r["elements_expected"] > 0, r


# --- a token corpus ------------------------------------------------------------------------------


WORDS = ("the quick brown fox jumps over lazy dog and runs far away from home while birds sing "
         "in tall green trees near a quiet river under the bright morning sun").split()


def write_corpus(root, docs: int = 400, seed: int = 0, url: str = "") -> str:
    """A small tokenized corpus (BPE trained on it) at url (default root/tokens); returns its URL."""
    rng = random.Random(seed)
    text = "\n\n".join(" ".join(rng.choice(WORDS) for _ in range(rng.randrange(40, 120))) for _ in range(docs))
    root.mkdir(parents=True, exist_ok=True)
    (root / "corpus.txt").write_text(text)
    url = url or str(root / "tokens")
    prepare(PrepareConfig([str(root / "corpus.txt")], url, vocab_size=300, eval_fraction=0.1, shard_tokens=4096, workers=1))
    return url
