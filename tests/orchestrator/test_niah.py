"""`kakeya niah` on the tiny pair: the JSON it prints, per policy and per (context, depth)."""

import json

import pytest

from kakeya.app.main import main
from kakeya.orchestrator.niah import build_prompt, haystack_lines, needle_code, needle_distance
from kakeya.orchestrator.text import TextCodec


@pytest.fixture(scope="module")
def ftheta_dir(tmp_path_factory, tiny_pair, mlx_target):
    from kakeya.drafter.mlx_backend.model import load_dflash_mlx
    from kakeya.verifier.mlx_backend.ftheta import Restorer

    out = tmp_path_factory.mktemp("niah_ftheta")
    draft = load_dflash_mlx(tiny_pair.draft, tiny_pair.target)
    Restorer.init(mlx_target, draft, rank=8, draft_dir=tiny_pair.draft, target_dir=tiny_pair.target).save(out)
    return out


def test_niah_json_shape(ftheta_dir, tiny_pair, capsys):
    # f_theta was trained against the tiny pair, not `niah`'s no-flag default (the demo pair)
    argv = [
        "niah",
        "--target",
        str(tiny_pair.target),
        "--draft",
        str(tiny_pair.draft),
        "--contexts",
        "128",
        "160",
        "--depths",
        "0.2",
        "0.8",
        "--policies",
        "native",
        "sink-window",
        "sink-window+kv8",
        "--restore",
        f"ftheta:{ftheta_dir}",
        "--max-tokens",
        "6",
        "--json",
        "--quiet",
    ]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["contexts"] == [128, 160] and out["depths"] == [0.2, 0.8]
    assert "machinery" in out["note"] and out["window"] == out["model_window"] // 2
    policies = out["policies"]
    assert list(policies) == ["native", "sink-window", "sink-window+kv8", "sink-window+restore"]
    assert policies["sink-window+restore"]["label"].endswith("+restore")
    for name, row in policies.items():
        assert 0.0 <= row["recall"] <= 1.0
        assert set(row["grid"]) == {"128", "160"} and all(set(v) == {"0.2", "0.8"} for v in row["grid"].values())
        assert set(row["by_context"]) == {"128", "160"} and set(row["by_depth"]) == {"0.2", "0.8"}
        assert row["recall_vs_native"] == round(row["recall"] - policies["native"]["recall"], 4)
        assert len(row["cases"]) == 4
        for case in row["cases"]:
            assert case["prompt_tokens"] <= case["context"] and len(case["needle"]) == 4
            assert case["recalled"] == (case["needle"] in case["output"])
        assert row["bounded"] == (name != "native")
    assert policies["sink-window+restore"]["max_kv_bytes"]["restored"] > 0
    assert policies["native"]["max_kv_bytes"]["restored"] == 0
    assert policies["sink-window+kv8"]["max_kv_bytes"]["full"] < policies["sink-window"]["max_kv_bytes"]["full"]


def test_prompt_holds_the_needle_at_its_depth(tiny_pair):
    codec = TextCodec(tiny_pair.target)
    lines = haystack_lines(8 * 1024)
    depths = []
    for depth in (0.0, 0.5, 1.0):
        code = needle_code(1024, depth)
        ids = build_prompt(codec, lines, 1024, depth, code)
        text = codec.decode(ids)
        assert 900 <= len(ids) <= 1024 and text.count(code) == 1 and text.endswith("The secret code is")
        depths.append(text.index(code) / len(text))
        distance = needle_distance(codec, ids, code)  # tokens from the code to the prompt's end
        assert codec.decode(ids[len(ids) - distance :]).lstrip().startswith(code)
        assert (distance < 80) if depth == 1.0 else (distance > 400)
    assert depths[0] < 0.1 and 0.3 < depths[1] < 0.7 and 0.85 < depths[2]


@pytest.mark.parametrize(
    "args,fragment",
    [
        (["--policies", "sink-window+restore"], "--restore"),
        (["--policies", "native+restore", "--restore", "/no/such/dir"], "sink-window"),
        (["--policies", "bogus"], "native"),
        (["--depths", "1.5"], "depths"),
        (["--contexts", "8"], "contexts"),
    ],
)
def test_niah_bad_input_is_one_line(capsys, args, fragment):
    assert main(["niah", "--contexts", "128", "--depths", "0.5", "--max-tokens", "2", "--quiet", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kakeya: error:") and fragment in err and "Traceback" not in err
