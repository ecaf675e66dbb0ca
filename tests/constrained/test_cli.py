"""The constrained-output flags of `kakeya generate` and `kakeya client generate`."""

from __future__ import annotations

import json

import pytest

from kakeya.app.main import build_parser, main

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}},
    "required": ["ok"],
    "additionalProperties": False,
}
TORCH = ["--backend", "torch", "--device", "cpu"]


def test_generate_with_a_schema_file_prints_valid_json_lossless(tmp_path, capsys):
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(SCHEMA))
    args = ["generate", *TORCH, "--json", "--compare-ar", "--max-tokens", "20", "--block-size", "4"]
    assert main([*args, "--json-schema", str(path)]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["lossless"] is True and out["finish_reason"] == "stop"
    assert set(json.loads(out["text"])) == {"ok"}


@pytest.mark.parametrize(
    "flags, fragment",
    [(["--regex", "a("], "--regex:"), (["--json-schema", "{nope"], "--json-schema:"), (["--grammar", "start: q"], "--grammar:")],
)  # fmt: skip
def test_a_bad_constraint_flag_is_one_line_naming_it(flags, fragment, capsys):
    assert main(["generate", *TORCH, "--max-tokens", "4", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kakeya: error:") and "\n" not in err and fragment in err, err


def test_two_constraint_flags_are_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--regex", "a", "--json-object"])
    assert "not allowed with" in capsys.readouterr().err


def test_client_generate_sends_the_constraint():
    from kakeya.app.client import generate_request
    from kakeya.wire.kakeya.v1 import sampling_pb2 as spb

    args = build_parser().parse_args(["client", "generate", "--choice", "yes", "--choice", "no"])
    req = generate_request(args)
    assert req.constraint == spb.Constraint(choice=spb.Constraint.Choices(choices=["yes", "no"]))
    args = build_parser().parse_args(["client", "generate", "--json-schema", json.dumps(SCHEMA)])
    assert json.loads(generate_request(args).constraint.json_schema) == SCHEMA
