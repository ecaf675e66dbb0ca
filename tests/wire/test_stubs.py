"""The committed stubs match protos/, and no field, enum value or RPC was renumbered.

``wire_contract.json`` is the frozen contract: every entry in it must still
exist with the same number and type. New fields may be added freely; after
adding some, record them with ``python -m tests.wire.test_stubs`` (which
rewrites the file) so they are frozen too.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONTRACT = Path(__file__).with_name("wire_contract.json")


def _modules():
    from kakeya.wire.kakeya.v1 import cache_pb2, drafter_pb2, generate_pb2, sampling_pb2, tensor_pb2, verifier_pb2

    return [tensor_pb2, cache_pb2, sampling_pb2, verifier_pb2, drafter_pb2, generate_pb2]


def describe() -> dict:
    """Every message field, enum value and RPC of kakeya.v1, by full name."""
    out: dict = {"messages": {}, "enums": {}, "services": {}}

    def enum(e):
        out["enums"][e.full_name] = {v.name: v.number for v in e.values}

    def message(d):
        fields = {}
        for f in d.fields:
            ref = f.message_type or f.enum_type
            fields[f.name] = {
                "number": f.number,
                "type": f.type,
                "repeated": f.is_repeated,
                "ref": ref.full_name if ref else "",
                "oneof": f.containing_oneof.name if f.containing_oneof else "",
            }
        out["messages"][d.full_name] = fields
        for n in d.nested_types:
            if not n.GetOptions().map_entry:
                message(n)
        for e in d.enum_types:
            enum(e)

    for mod in _modules():
        fd = mod.DESCRIPTOR
        for d in fd.message_types_by_name.values():
            message(d)
        for e in fd.enum_types_by_name.values():
            enum(e)
        for s in fd.services_by_name.values():
            out["services"][s.full_name] = {
                m.name: {
                    "input": m.input_type.full_name,
                    "output": m.output_type.full_name,
                    "client_streaming": m.client_streaming,
                    "server_streaming": m.server_streaming,
                }
                for m in s.methods
            }
    return out


def test_stubs_are_fresh():
    r = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_protos.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stdout + r.stderr


def test_stubs_import_as_a_package():
    from kakeya.wire.kakeya.v1 import drafter_pb2_grpc, generate_pb2_grpc, verifier_pb2, verifier_pb2_grpc

    assert verifier_pb2_grpc.VerifierServiceStub and drafter_pb2_grpc.DrafterServiceStub
    assert generate_pb2_grpc.GenerationStub
    req = verifier_pb2.VerifierRequest(verify=verifier_pb2.VerifierRequest.Verify(block_ids=[5, 6]))
    again = verifier_pb2.VerifierRequest.FromString(req.SerializeToString())
    assert again.WhichOneof("request") == "verify" and list(again.verify.block_ids) == [5, 6]


def test_nothing_renumbered():
    frozen = json.loads(CONTRACT.read_text())
    now = describe()
    problems = []
    for kind in ("messages", "enums", "services"):
        for name, entries in frozen[kind].items():
            if name not in now[kind]:
                problems.append(f"{kind[:-1]} {name} is gone")
                continue
            for entry, spec in entries.items():
                got = now[kind][name].get(entry)
                if got != spec:
                    problems.append(f"{name}.{entry}: frozen {spec}, now {got}")
    assert not problems, "wire contract broken (append new numbers instead):\n" + "\n".join(problems)


def test_contract_file_is_complete():
    """Everything in the protos is frozen in wire_contract.json (regenerate it after adding)."""
    frozen = json.loads(CONTRACT.read_text())
    now = describe()
    missing = [
        f"{name}.{entry}"
        for kind in ("messages", "enums", "services")
        for name, entries in now[kind].items()
        for entry in entries
        if entry not in frozen[kind].get(name, {})
    ]
    assert not missing, f"not yet frozen, run `python -m tests.wire.test_stubs`: {missing}"


def test_enums_reserve_zero_for_unspecified():
    for name, values in describe()["enums"].items():
        zero = [v for v, n in values.items() if n == 0]
        assert zero and zero[0].endswith("_UNSPECIFIED"), name


if __name__ == "__main__":
    CONTRACT.write_text(json.dumps(describe(), indent=1, sort_keys=True) + "\n")
    print(f"wrote {CONTRACT}")
