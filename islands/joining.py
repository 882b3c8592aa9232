"""Joining a run, for every kind of island: rank 0 joins, every rank gets the reply and checks it.

One place for the join and the validation of its reply, whatever the island's kind.
"""

from __future__ import annotations

import logging

import grpc

from diloco.config import ConfigError, RunConfig, config_from_toml
from diloco.data.sources import resolve_vocab
from diloco.fragments import FragmentLayout, layout_for
from diloco.v1 import diloco_pb2 as pb
from diloco.wire.messages import Manifest, uplink_codec
from diloco.wire.refusal import Reason, refusal_of
from islands.client import CoordinatorClient
from islands.outcome import Next, next_step, reason_name
from islands.world import IslandWorld

log = logging.getLogger(__name__)


class JoinRefused(ValueError):
    """The coordinator will not have this island (another config, codec or release; a full run)."""


def join_run(
    client: CoordinatorClient | None, world: IslandWorld, cfg: RunConfig | None, island_id: str = "", key: str = "",
    groups: int = 1,
) -> tuple[pb.JoinResponse, RunConfig] | None:
    """Rank 0 joins (cfg None: adopt the coordinator's config); every rank gets the reply and the run's config.

    None when the run has already finished (nothing to do); JoinRefused with the
    coordinator's reason and message when it will not have us.
    """
    reply: bytes | tuple[str, str] | None = None
    if cfg is not None and cfg.data.source == "tokens" and not cfg.model.vocab_size:
        resolve_vocab(cfg)  # as the coordinator does, so that the digests agree
    if world.is_leader:
        codec = uplink_codec(cfg.wire).name if cfg is not None else ""
        try:
            reply = client.join(cfg.digest() if cfg is not None else "", codec, island_id, key,
                                ranks=groups * world.world_size).SerializeToString()
        except grpc.RpcError as e:
            reply = (next_step(e).value, f"{reason_name(e)}: {_refusal_details(e, cfg)}")
    reply = world.broadcast_object(reply)
    if isinstance(reply, tuple):
        step, message = reply
        if Next(step) is Next.FINISHED:
            log.info("the run has finished; nothing to do")
            return None
        raise JoinRefused(f"coordinator refused the join: {message}")
    joined = pb.JoinResponse.FromString(reply)
    if world.is_leader:
        log.info("joined %s as %s%s at round %d%s", getattr(client, "address", "the coordinator"), joined.island_id,
                 f" (replacing a live process from {joined.replaced})" if joined.replaced else "", joined.round,
                 "" if cfg is not None else f", adopting its config {joined.config_digest} (no --config)")
    return joined, cfg if cfg is not None else config_from_toml(joined.config_toml)


SHOWN_KEYS = 8  # keys of a config mismatch named in its one line; the rest counted


def _refusal_details(e: grpc.RpcError, cfg: RunConfig | None) -> str:
    """The coordinator's message; for a config mismatch, the keys that differ (from the coordinator's config, which
    comes with the refusal) instead of only the two digests."""
    refusal = refusal_of(e)
    if refusal.reason != Reason.CONFIG_MISMATCH or not refusal.config_toml or cfg is None:
        return e.details()
    try:
        theirs = config_from_toml(refusal.config_toml)
    except (ConfigError, ValueError):  # tomllib's errors are ValueErrors
        return e.details()
    differ = cfg.differing_keys(theirs)
    if not differ:  # a digest computed otherwise (another release): the coordinator's digests say it all
        return e.details()
    named = ", ".join(f"{k} (here {ours!r}, the coordinator's {its!r})" for k, ours, its in differ[:SHOWN_KEYS])
    more = f" and {len(differ) - SHOWN_KEYS} more" if len(differ) > SHOWN_KEYS else ""
    return (f"this island's config differs from the coordinator's in {named}{more}; start the island with the "
            "coordinator's config file, or without --config to adopt it")


def check_join_reply(joined: pb.JoinResponse, cfg: RunConfig, model_manifest: Manifest) -> FragmentLayout:
    """The run's codec, parameters and fragment layout must be this island's; returns the layout."""
    codec = uplink_codec(cfg.wire).name
    if codec != joined.codec:
        raise JoinRefused(f"this island's codec {codec!r} is not the run's {joined.codec!r}; use the coordinator's config")
    if Manifest.from_proto(joined.parameters) != model_manifest:
        raise JoinRefused("the coordinator's parameter manifest does not match this island's model; check model config")
    layout = layout_for(model_manifest.shapes, cfg)
    if joined.fragments and [tuple(f.names) for f in joined.fragments] != [f.names for f in layout]:
        raise JoinRefused("the coordinator's fragment layout differs from this island's; use the coordinator's config")
    return layout
