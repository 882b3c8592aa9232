"""The committed stubs in diloco/v1 are what protos/ generates: stale stubs fail here."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]
PROTO = "diloco/v1/diloco.proto"


def _generate(out: Path, *flags: str) -> None:
    pytest.importorskip("grpc_tools", reason="install the test extras: pip install -e '.[test]'")
    cmd = [sys.executable, "-m", "grpc_tools.protoc", f"-I{ROOT / 'protos'}", *flags, str(ROOT / "protos" / PROTO)]
    subprocess.run(cmd, check=True, cwd=out, capture_output=True)


def test_descriptor_matches_proto(tmp_path):
    from google.protobuf import descriptor_pb2

    from diloco.v1 import diloco_pb2

    _generate(tmp_path, f"--descriptor_set_out={tmp_path / 'set.pb'}")
    fresh = descriptor_pb2.FileDescriptorSet.FromString((tmp_path / "set.pb").read_bytes()).file[0]
    committed = descriptor_pb2.FileDescriptorProto.FromString(diloco_pb2.DESCRIPTOR.serialized_pb)
    # protoc adds derived json_name fields to descriptor sets; the embedded copy omits them.
    messages = list(fresh.message_type)
    while messages:  # nested ones too (a map's entry type)
        message = messages.pop()
        messages.extend(message.nested_type)
        for f in message.field:
            f.ClearField("json_name")
    assert fresh == committed, "diloco/v1/diloco_pb2.py is stale; regenerate (docs/protocol.md)"


def test_generated_files_are_identical(tmp_path):
    _generate(tmp_path, f"--python_out={tmp_path}", f"--pyi_out={tmp_path}", f"--grpc_python_out={tmp_path}")
    for name in ("diloco_pb2.py", "diloco_pb2.pyi", "diloco_pb2_grpc.py"):
        fresh = (tmp_path / "diloco" / "v1" / name).read_text()
        committed = (ROOT / "diloco" / "v1" / name).read_text()
        assert fresh == committed, f"diloco/v1/{name} is stale; regenerate (docs/protocol.md)"
