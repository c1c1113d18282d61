"""The README's main job (`python -m kvq_compile.demo`) on a short run: its numbers, not just that it ran."""
import pytest

from kvq_compile import KVQConfig, demo


@pytest.mark.parametrize("name", ["kivi-2"])   # int8 ran too when written (one case keeps CI short)
def test_demo_reports_its_presets(name):
    lines = []
    fp16, row = demo.run(presets=("fp16", name), new_tokens=6, out=lines.append)
    assert len(lines) == 4 and lines[2].split()[0] == "fp16" and lines[3].split()[0] == name
    # the fp16 store holds the cache exactly: the same greedy tokens; every layer rewritten
    assert fp16["greedy"] == 1.0 and fp16["snr_db"] > 30 and fp16["layers"] == row["layers"] == 4
    assert fp16["bits"] == pytest.approx(16, abs=0.2) and fp16["bits_long"] == pytest.approx(16, abs=0.01)
    # the long-context column is the config's own count for that cache, and well below the short one's
    assert row["bits_long"] == pytest.approx(KVQConfig.preset(name).equivalent_bits(**demo.LONG))
    assert row["bits_long"] < {"int8": 8.2, "kivi-2": 3.1}[name] < row["bits"]
    assert row["store_mib"] < fp16["store_mib"]
    assert row["snr_db"] > {"int8": 30, "kivi-2": 5}[name]
