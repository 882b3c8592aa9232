"""Push slots (coordinator/limits.py PushSlots): the coordinator reads at most limits.push_slots pushes at once,
each island at most its share, and an island sends its chunks only once admitted (islands/client.py admitted_push).

What the slots bound: gRPC buffers up to limits.receive_window_mb of every push stream the coordinator has not
read yet, so without them the memory the transport holds grows with the islands and ranks pushing at once
(docs/benchmarks.md, the coordinator's memory). The default (32) is above what a test of a few islands opens, so
the tests that need a slot to be taken set fewer, and say so.
"""

from __future__ import annotations

import logging
import threading
import time
from contextlib import ExitStack

import grpc
import pytest
import torch
from conftest import claim, join, tiny_config, trained_from

from coordinator.limits import Abandoned, PushSlots
from diloco.security import credentials
from diloco.v1 import diloco_pb2 as pb
from diloco.v1 import diloco_pb2_grpc as pb_grpc
from diloco.wire.codec import Fp32Codec
from diloco.wire.frames import push_frames, stub_for
from diloco.wire.messages import PROTOCOL_VERSION, push_messages, tensor_chunks
from islands.client import admitted_push

BOUND_S = 60.0  # generous: the events these tests wait for come in milliseconds on an idle machine


def until(condition, what: str, timeout_s: float = BOUND_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s:g}s")
        time.sleep(0.01)


class Holder:
    """A thread holding a slot for an island from when it gets one until release() (admitted: an Event)."""

    def __init__(self, slots: PushSlots, island: str, still_wanted=lambda: True):
        self.admitted, self.done, self.error = threading.Event(), threading.Event(), None
        self._release = threading.Event()

        def hold() -> None:
            try:
                with slots.slot(island, still_wanted):
                    self.admitted.set()
                    self._release.wait(BOUND_S)
            except Abandoned as e:
                self.error = e
            finally:
                self.done.set()

        self.thread = threading.Thread(target=hold, daemon=True)
        self.thread.start()

    def release(self) -> None:
        self._release.set()
        self.thread.join(BOUND_S)


@pytest.mark.unit
def test_an_island_holds_at_most_its_share_and_the_others_get_the_rest():
    slots = PushSlots(2, members=lambda: 2)  # a share of 1 each
    first = Holder(slots, "a")
    until(first.admitted.is_set, "a's first push admitted")
    second = Holder(slots, "a")
    until(lambda: slots.status()["waiting"] == 1, "a's second push waiting")
    assert not second.admitted.is_set(), "a took a second slot beyond its share while one was free"
    other = Holder(slots, "b")
    until(other.admitted.is_set, "b admitted to the free slot past a's waiting push")
    first.release()
    until(second.admitted.is_set, "a's second push admitted once its first ended")
    assert slots.status() == {"held": 2, "waiting": 0, "bound": 2}
    second.release()
    other.release()
    assert slots.status() == {"held": 0, "waiting": 0, "bound": 2}


@pytest.mark.unit
def test_the_waiting_go_in_arrival_order():
    slots = PushSlots(1, members=lambda: 3)
    a = Holder(slots, "a")
    until(a.admitted.is_set, "a admitted")
    b = Holder(slots, "b")
    until(lambda: slots.status()["waiting"] == 1, "b waiting")
    c = Holder(slots, "c")
    until(lambda: slots.status()["waiting"] == 2, "c waiting")
    a.release()
    until(b.admitted.is_set, "b, which came first, admitted")
    assert not c.admitted.is_set()
    b.release()
    until(c.admitted.is_set, "c admitted after b")
    c.release()


@pytest.mark.unit
def test_no_bound_admits_every_push_at_once():
    slots = PushSlots(0, members=lambda: 1)
    with ExitStack() as stack:
        for _ in range(100):
            stack.enter_context(slots.slot("a", lambda: True))


@pytest.mark.unit
def test_a_push_gone_while_it_waits_gives_up_its_place():
    slots = PushSlots(1, members=lambda: 2)
    holder = Holder(slots, "a")
    until(holder.admitted.is_set, "a admitted")
    wanted = threading.Event()
    wanted.set()
    gone = Holder(slots, "b", still_wanted=wanted.is_set)
    until(lambda: slots.status()["waiting"] == 1, "b waiting")
    wanted.clear()  # the island cancelled, or the coordinator is stopping
    until(gone.done.is_set, "the waiting push given up")
    assert isinstance(gone.error, Abandoned) and not gone.admitted.is_set()
    assert slots.status() == {"held": 1, "waiting": 0, "bound": 1}
    holder.release()


def _zeros(coordinator) -> dict[str, torch.Tensor]:
    return {n: torch.zeros(s) for n, s in coordinator.state.manifest.shapes.items()}


def _header(cfg, coordinator, island_id: str) -> pb.PushHeader:
    return pb.PushHeader(island_id=island_id, round=0, codec="fp32", global_checksum=trained_from(coordinator, 0),
                         **claim(cfg))


def _held_open(messages: list, release: threading.Event):
    """A push stream that sends its header and first chunk, then holds its stream open until release."""
    yield from messages[:2]
    release.wait(BOUND_S)
    yield from messages[2:]


@pytest.mark.integration
def test_a_push_sends_its_chunks_only_once_admitted(make_coordinator, channel_to, monkeypatch, caplog):
    # One slot (the default 32 is more than two islands take): the second island's push must wait for the first's.
    monkeypatch.setattr("islands.client.SLOT_NOTICE_S", 0.0)  # the island says at once that it waits (10 s by default)
    caplog.set_level(logging.INFO, logger="islands.client")
    cfg = tiny_config("rounds.rounds=1", "rounds.min_islands=2", "limits.push_slots=1")
    coordinator = make_coordinator(cfg)
    stub = channel_to(coordinator)
    a, b = join(stub, cfg.digest()).island_id, join(stub, cfg.digest()).island_id
    first = list(push_messages(_header(cfg, coordinator, a), tensor_chunks(_zeros(coordinator), Fp32Codec(), 4096)))
    release = threading.Event()
    held = stub.PushPseudoGradient.future(_held_open(first, release), timeout=BOUND_S)
    slots = coordinator.state.push_slots
    until(lambda: slots.status()["held"] == 1, "the first push admitted")

    sent: list[int] = []

    def counted():
        for frame in push_frames(_header(cfg, coordinator, b), tensor_chunks(_zeros(coordinator), Fp32Codec(), 4096)):
            sent.append(len(frame))
            yield frame

    outcome: dict = {}
    channel = grpc.insecure_channel(f"127.0.0.1:{coordinator.port}")
    second = threading.Thread(target=lambda: outcome.setdefault("reply", admitted_push(stub_for(channel), counted(), BOUND_S)))
    try:
        second.start()
        until(lambda: slots.status()["waiting"] == 1, "the second push waiting for the slot")
        assert len(sent) == 1, f"the waiting island sent {len(sent) - 1} chunks before it was admitted"
        until(lambda: "waits for one of the coordinator's push slots" in caplog.text, "the island saying it waits")
        release.set()
        assert held.result(timeout=BOUND_S).contribution_complete
        second.join(BOUND_S)
        assert outcome["reply"].contribution_complete and len(sent) > 2
    finally:
        release.set()
        channel.close()
    assert coordinator.wait(BOUND_S), "the round did not close on both pushes"
    assert slots.status() == {"held": 0, "waiting": 0, "bound": 1}


@pytest.mark.integration
def test_an_attacker_holding_a_valid_key_cannot_keep_honest_pushes_out(tls_coordinator, run_ca):
    """Mallory (a valid key) opens pushes and never finishes them. She holds her share, one slot of two; east's
    push takes the other. Without shares her two streams would hold both slots and east would wait for them to be
    cut off. push_idle_s is raised so that her streams outlast the test: the share, not the idle cut-off, lets east in."""
    cfg = tiny_config("rounds.rounds=1", "rounds.min_islands=2", "limits.push_slots=2", "limits.push_idle_s=600")
    coordinator = tls_coordinator(cfg)
    channels, stubs = [], {}
    for name in ("mallory", "east"):
        ca, cert, key = credentials.island_files(run_ca, name).read()
        channels.append(grpc.secure_channel(f"127.0.0.1:{coordinator.port}", grpc.ssl_channel_credentials(ca, key, cert)))
        stubs[name] = pb_grpc.CoordinatorStub(channels[-1])
    release = threading.Event()
    try:
        ids = {name: stub.Join(pb.JoinRequest(protocol_version=PROTOCOL_VERSION), timeout=30).island_id
               for name, stub in stubs.items()}
        zeros = _zeros(coordinator)
        messages = list(push_messages(_header(cfg, coordinator, ids["mallory"]), tensor_chunks(zeros, Fp32Codec(), 4096)))
        held = [stubs["mallory"].PushPseudoGradient.future(_held_open(messages, release), timeout=BOUND_S) for _ in range(2)]
        slots = coordinator.state.push_slots
        until(lambda: slots.status()["held"] == 1 and slots.status()["waiting"] == 1,
              "one of mallory's pushes reading, the other waiting (her share is one)")
        honest = stub_for(channels[1])
        frames = push_frames(_header(cfg, coordinator, ids["east"]), tensor_chunks(zeros, Fp32Codec(), 4096))
        assert admitted_push(honest, frames, BOUND_S).contribution_complete
        assert slots.status()["held"] == 1, "mallory's streams were cut off: the test shows nothing about shares"
        for call in held:
            call.cancel()
        until(lambda: slots.status() == {"held": 0, "waiting": 0, "bound": 2}, "mallory's cancelled pushes freed their slot and place")
    finally:
        release.set()
        for channel in channels:
            channel.close()


@pytest.mark.integration
def test_a_push_waiting_when_the_coordinator_stops_ends_as_a_restart_and_keeps_nothing(make_coordinator, channel_to):
    # One slot, held by a push that never finishes, so the second one waits (the default 32 never binds here).
    cfg = tiny_config("rounds.min_islands=2", "limits.push_slots=1")
    coordinator = make_coordinator(cfg)
    stub = channel_to(coordinator)
    a, b = join(stub, cfg.digest()).island_id, join(stub, cfg.digest()).island_id
    first = list(push_messages(_header(cfg, coordinator, a), tensor_chunks(_zeros(coordinator), Fp32Codec(), 4096)))
    release = threading.Event()
    held = stub.PushPseudoGradient.future(_held_open(first, release), timeout=BOUND_S)
    slots = coordinator.state.push_slots
    until(lambda: slots.status()["held"] == 1, "the first push admitted")
    outcome: dict = {}
    channel = grpc.insecure_channel(f"127.0.0.1:{coordinator.port}")

    def second() -> None:
        frames = push_frames(_header(cfg, coordinator, b), tensor_chunks(_zeros(coordinator), Fp32Codec(), 4096))
        try:
            admitted_push(stub_for(channel), frames, BOUND_S)
        except grpc.RpcError as e:
            outcome["code"] = e.code()

    thread = threading.Thread(target=second)
    try:
        thread.start()
        until(lambda: slots.status()["waiting"] == 1, "the second push waiting")
        coordinator.stop(0.5)
        thread.join(BOUND_S)
        # What islands retry as the coordinator's restart (islands/client.py _retry); neither push was kept.
        assert outcome.get("code") in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE), outcome
        assert not coordinator.state.fragments[0].contributions
    finally:
        release.set()
        channel.close()
        held.cancel()
