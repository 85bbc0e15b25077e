"""benchmarks/hf_stage3.py at a tiny size: every engine runs, and zero's
stages 2 and 3 train the Hugging Face GPT-2 like FSDP2 does (fp32 losses)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import hf_stage3  # noqa: E402


@pytest.mark.slow
def test_engines_agree_and_the_table_prints(tmp_path, capsys) -> None:
    out = tmp_path / "hf.json"
    code = hf_stage3.main(["--models", "gpt2", "--dtypes", "fp32", "--engines", "zero2,zero3,fsdp2-ringcomm",
                           "--rounds", "1", "--steps", "4", "--skip", "1", "--layers", "2", "--hidden", "64",
                           "--vocab", "256", "--seq", "32", "--json", str(out)])
    assert code == 0
    row = json.loads(out.read_text())["results"]["gpt2/fp32"]
    reference = row["fsdp2-ringcomm"]["losses"]
    assert len(reference) == 4 and reference[-1] < reference[0], f"FSDP2's loss does not fall: {reference}"
    for engine in ("zero2", "zero3"):
        assert row[engine]["step_ms"] > 0 and row[engine]["peak_rss_mib"] > 0, row[engine]
        for step, (a, b) in enumerate(zip(reference, row[engine]["losses"])):
            assert abs(a - b) <= 1e-5 * abs(a), f"{engine} step {step}: loss {b} vs FSDP2's {a}"
    table = capsys.readouterr().out
    assert "zero3 / fsdp2-ringcomm" in table and "zero3 / zero2" in table, table
