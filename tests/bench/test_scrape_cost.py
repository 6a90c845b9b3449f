"""bench.scrape_cost's command line refuses counts that would measure nothing (the measurement itself
needs a real vLLM pod: run by hand, figures in bench/RESULTS.md's grid notes)."""

from __future__ import annotations

import pytest

from bench.scrape_cost import main


@pytest.mark.parametrize("args", [["--scrapes", "0"], ["--rounds", "0"]])
def test_zero_counts_are_refused(args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--vllm-python", "python", "--model", "m", *args])
    assert exc.value.code == 2
    assert "--scrapes and --rounds must be at least 1" in capsys.readouterr().err
