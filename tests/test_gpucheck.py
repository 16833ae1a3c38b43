"""`recipes gpucheck`: one line and exit 0 without a GPU; its parity check runs (blockwise) anywhere."""
import json

from recipes import gpucheck


def test_without_a_gpu_it_says_so_and_exits_0(capsys):
    assert gpucheck.main([]) == 0
    (line,) = capsys.readouterr().out.strip().splitlines()
    row = json.loads(line)
    assert row["skipped"] is True and "no GPU" in row["reason"]


def test_parity_check_compares_against_the_reference():
    row = gpucheck.attention_parity(length=128, segments=2)
    assert row["blockwise_ok"] and set(row["blockwise_rel_err"]) == {"out", "dq", "dk", "dv"}
