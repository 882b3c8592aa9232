"""The convergence benchmark's wire: pseudo-gradients and updates through the deployed codecs.

Split from benchmarks/convergence.py (which runs the jobs) to keep each file short.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from coordinator.publish import Publication  # the coordinator's own downlink arithmetic
from diloco.wire.codec import get_codec
from diloco.config import ConfigError, RunConfig
from diloco.wire.feedback import ErrorFeedback
from diloco.outer import PseudoGradientAccumulator
from diloco.robust import NormGuard, Sketcher, cosines
from diloco.v1 import diloco_pb2 as pb
from diloco.wire.messages import Manifest, decode_chunk, downlink_codec, tensor_chunks, uplink_codec


class Wire:
    """The coordinator's and islands' arithmetic for one round trip through the codecs.

    Uplink: each island's pseudo-gradient goes through `tensor_chunks` (with the
    island's error feedback where the config asks for it), and the decoded chunks
    are folded into the accumulator exactly as the coordinator folds them.
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
        self.publication = Publication(outer_params, downlink_codec(cfg.wire), cfg.wire.chunk_bytes)
        self.bytes_up = self.bytes_down = 0
        self.sketcher = Sketcher(b"convergence")  # the guard's direction check, as the coordinator sketches at intake
        self.least_cosine = math.inf  # the lowest cosine between two islands' pushes of a round, over the run

    def push(self, island: int, pg: dict[str, torch.Tensor]) -> tuple[list, float, np.ndarray]:
        """The island's pseudo-gradient as the coordinator receives it: (chunk, decoded values) pairs, the sum of
        squares of the values and their sketch (what the guard judges)."""
        received, sumsq, sketch = [], 0.0, self.sketcher.empty()
        for chunk in tensor_chunks(pg, self.codec, self.cfg.wire.chunk_bytes, feedback=self.feedback[island]):
            self.bytes_up += pb.PushMessage(chunk=chunk).ByteSize()
            values = decode_chunk(chunk, self.manifest, self.codec)
            received.append((chunk, values))
            sumsq += float(torch.dot(values.double(), values.double()))
            self.sketcher.add(sketch, chunk.name, chunk.offset, values.numpy())
        return received, sumsq, sketch

    def fold_round(self, accumulator: PseudoGradientAccumulator, pushed: list[tuple[list, float, np.ndarray]], tokens: int,
                   guard: NormGuard, lr_sum: float) -> int:
        """As coordinator/rounds.py folds a round: the guard judges every push's norm per unit of inner lr and its
        direction, then each is folded in island order with its token weight times its factor. Returns how many were
        clipped or dropped."""
        verdict = guard.judge({str(i): math.sqrt(sumsq) / lr_sum for i, (_, sumsq, _) in enumerate(pushed)}, "",
                              {str(i): sketch for i, (_, _, sketch) in enumerate(pushed)})
        self.least_cosine = min([self.least_cosine, *cosines({str(i): sketch for i, (_, _, sketch) in enumerate(pushed)}).values()])
        for i, (received, _, _) in enumerate(pushed):
            factor = verdict.factors[str(i)]
            if factor == 0.0:
                continue
            scale = accumulator.scale_for(tokens) * factor
            for chunk, values in received:
                accumulator.add_chunk(chunk.name, chunk.offset, values, scale)
            accumulator.commit(tokens)
        if not accumulator.contributions:  # every contribution dropped: a zero mean
            accumulator.commit(0)
        return len(verdict.clipped) + len(verdict.dropped)

    def publish(self, islands: int) -> dict[str, torch.Tensor]:
        """After the outer step: what every island now holds as theta_global."""
        self.publication.publish()
        per_island = sum(pb.ResultMessage(chunk=c).ByteSize() for c in self.publication.delta_chunks) or sum(
            pb.ResultMessage(chunk=c).ByteSize() for c in tensor_chunks(self.publication.params, self.publication.codec, self.cfg.wire.chunk_bytes)
        )
        self.bytes_down += islands * per_island
        return self.publication.params


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
