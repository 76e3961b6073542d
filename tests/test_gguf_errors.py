"""A GGUF file that cannot be a target gets one short line naming the cause: not a GGUF, truncated, a damaged
header, an unsupported architecture, not a causal LM."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("gguf", reason="the gguf package is not installed (pip install gguf)")

from gguf_fixture import damaged_copies, write_tiny_gguf  # noqa: E402

from spectrain.cli import main as cli_main  # noqa: E402
from spectrain.targets import gguf as G  # noqa: E402


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("bad-gguf")
    out = damaged_copies(write_tiny_gguf(d / "good.gguf"), d)
    out["seq2seq"] = write_tiny_gguf(d / "t5.gguf", arch="t5")
    out["unsupported"] = write_tiny_gguf(d / "fancy.gguf", arch="fancyarch")
    return out


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECTRAIN_CACHE_DIR", str(tmp_path / "cache"))


@pytest.mark.parametrize("kind, cause", [
    ("not_gguf", "is not a GGUF file"), ("empty", "is not a GGUF file"), ("truncated", "is truncated"),
    ("truncated_tail", "is truncated"), ("damaged_header", "has a damaged header: it declares"),
])
def test_a_broken_file_is_named_for_what_is_wrong(files, kind, cause):
    with pytest.raises(G.GGUFError, match=cause):
        G.resolve_target_path(str(files[kind]))


def test_an_unsupported_architecture_and_a_seq2seq_model_are_told_apart(files, tmp_path):
    with pytest.raises(G.GGUFError, match="architecture 'fancyarch' is not one transformers .* reads") as e:
        G.resolve_target_path(str(files["unsupported"]))
    assert "llama" in str(e.value) and len(str(e.value)) < 500  # the supported list, not 300 config classes
    with pytest.raises(G.GGUFError, match="holds a t5 model .*not a causal LM") as e:
        G.resolve_target_path(str(files["seq2seq"]))
    assert len(str(e.value)) < 300
    assert not (tmp_path / "cache").exists()  # refused before anything was written


@pytest.mark.parametrize("kind", ["truncated", "damaged_header", "seq2seq"])
def test_the_cli_prints_one_short_line_and_exits_2(files, kind, capsys):
    rc = cli_main(["check", "tiny/medusa", f"target.name_or_path={files[kind]}"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and "Traceback" not in err
    assert len(err) < 400 and "JSON" not in err and "architecture or quantization" not in err
