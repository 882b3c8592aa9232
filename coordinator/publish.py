"""What islands hold: the published global parameters and the last round's update.

With a lossless downlink the published parameters are the outer optimizer's own.
With a lossy one the coordinator sends each round's update compressed and adds
exactly what it sent to its published copy, so the published copy and every
island's stay bit-identical; the outer parameters keep full precision and the
gap between the two (theta_outer - theta_published) is the downlink's error
feedback, carried into the next round's update.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

import torch

from diloco.codec import Codec, get_codec
from diloco.params import checksum
from diloco.v1 import diloco_pb2 as pb
from diloco.wire import Manifest, decode_chunk, encode_chunks, tensor_chunks


class Publication:
    def __init__(self, outer_params: Mapping[str, torch.Tensor], codec: Codec, chunk_bytes: int):
        self.outer_params = outer_params
        self.codec = codec
        self.chunk_bytes = chunk_bytes
        self.lossless = codec.name == "fp32"
        self.manifest = Manifest.of(outer_params)
        self.params = dict(outer_params) if self.lossless else {n: t.clone() for n, t in outer_params.items()}
        self.checksum = checksum(self.params)
        # The last round's update: it takes params with delta_base to params with checksum.
        self.delta_chunks: list[pb.TensorChunk] = []
        self.delta_base = ""
        self._values: list[tuple[pb.ResultMessage, int]] | None = None
        self._values_lock = threading.Lock()

    def value_messages(self) -> list[tuple[pb.ResultMessage, int]]:
        """The published parameters as fp32 value chunks in result messages, with their sizes on the wire.

        Encoded once per round, on the first pull that wants values, and shared by
        every island's pull after it: one copy of the model, however many islands.
        Callers hold the parameters' read lock, so publish() cannot run meanwhile.
        """
        with self._values_lock:
            if self._values is None:
                chunks = tensor_chunks(self.params, get_codec("fp32"), self.chunk_bytes)
                self._values = [(m, m.ByteSize()) for m in (pb.ResultMessage(chunk=c) for c in chunks)]
            return self._values

    def release_values(self) -> None:
        """The round closed: drop the value messages before the outer step needs memory (pulls under way keep theirs)."""
        with self._values_lock:
            self._values = None

    @torch.no_grad()
    def publish(self) -> None:
        """Called after each outer step, under the parameters' write lock."""
        self._values = None
        if self.lossless:
            self.delta_chunks, self.delta_base = [], ""
        else:
            chunks = []
            for name, outer in self.outer_params.items():
                published = self.params[name].view(-1)
                gap = outer.view(-1) - published
                for chunk in encode_chunks(name, gap, self.codec, self.chunk_bytes):
                    decoded = decode_chunk(chunk, self.manifest, self.codec)
                    published[chunk.offset : chunk.offset + chunk.numel].add_(decoded)
                    chunks.append(chunk)
            self.delta_chunks, self.delta_base = chunks, self.checksum
        self.checksum = checksum(self.params)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {} if self.lossless else {n: t.clone() for n, t in self.params.items()}

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        if not self.lossless:
            for name, t in state.items():
                self.params[name].copy_(t)
        self.delta_chunks, self.delta_base, self._values = [], "", None
        self.checksum = checksum(self.params)
