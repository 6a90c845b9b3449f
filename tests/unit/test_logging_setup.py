"""kvroute's logging: JSON lines on stderr, the libraries' debug chatter kept out of a debug log."""

from __future__ import annotations

import json
import logging

import pytest

from extproc.observability import setup_logging


@pytest.fixture
def restored_logging():
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    levels = {name: logging.getLogger(name).level for name in ("grpc", "hpack")}
    yield
    root.handlers[:], level = saved
    root.setLevel(level)
    for name, lvl in levels.items():
        logging.getLogger(name).setLevel(lvl)


def test_a_debug_log_has_kvroutes_lines_and_not_hpacks(restored_logging, capsys):
    setup_logging("debug")
    logging.getLogger("hpack.hpack").debug("Decoded (b':path', ...)")
    logging.getLogger("grpc._cython.cygrpc").debug("Using AsyncIOEngine.POLLER as I/O engine")
    logging.getLogger("kvroute.router").debug("routed")
    lines = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    assert [(d["logger"], d["msg"]) for d in lines] == [("kvroute.router", "routed")]
    logging.getLogger("hpack.hpack").warning("a real problem")
    assert json.loads(capsys.readouterr().err)["msg"] == "a real problem"
