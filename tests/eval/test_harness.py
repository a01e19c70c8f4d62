"""The evaluations' shared harness without a model: table cells as the commands always printed them, one engine
alive at a time, passkey accuracy by depth."""
from __future__ import annotations

import gc
import weakref

import pytest

from kvcache.eval.harness import Column, PasskeyTrial, Table, each_engine, fmt, passkey_accuracy


def test_table_cells_match_padded_format_specs(capsys):
    table = Table((Column("kv cache", 17, left=True), Column("bytes/tok", 10, ","), Column("KL nats", 11, ".2e"),
                   Column("ppl Δ%", 9, "+.2f"), Column("passkey", 9, ".0%"), Column("speedup", 9, ".2f", suffix="x")))
    row = ["int8", 8640, 1.234e-4, -0.5, None, 1.5]
    assert table.header() == (f"{'kv cache':<17}{'bytes/tok':>10}{'KL nats':>11}{'ppl Δ%':>9}{'passkey':>9}"
                              f"{'speedup':>9}")
    assert table.line(row) == (f"{'int8':<17}{8640:>10,}{1.234e-4:>11.2e}{-0.5:>+9.2f}{fmt(None, '.0%'):>9}"
                               f"{fmt(1.5, '.2f'):>8}x")
    table.print([row])
    head, rule, line = capsys.readouterr().out.splitlines()
    assert rule == "-" * len(head) and line == table.line(row)
    with pytest.raises(ValueError, match="2 values for a table of 6 columns"):
        table.line(["int8", 1])


def test_gapped_columns_and_a_note_end_the_header():
    table = Table((Column("policy", 12, left=True), Column("d0", 9, ".0%", gap="  "), Column("d1", 9, ".0%", gap=" ")),
                  note="   (by depth)")
    assert table.header() == f"{'policy':<12}  " + " ".join(f"{d:>9}" for d in ("d0", "d1")) + "   (by depth)"
    assert table.line(["full cache", 1.0, "0%/100%"]) == f"{'full cache':<12}  {'100%':>9} {'0%/100%':>9}"
    assert fmt(None, "g") == "-" and fmt("-", "g") == "-" and fmt(0.25, "g") == "0.25"


def test_each_engine_frees_one_before_building_the_next():
    class Engine:
        pass

    alive: list[weakref.ref] = []

    def build(config):
        gc.collect()
        assert all(r() is None for r in alive), "an earlier engine is still alive"
        engine = Engine()
        alive.append(weakref.ref(engine))
        return engine

    assert each_engine([1, 2, 3], build, lambda e, c: c * 10, "test") == [10, 20, 30]
    assert len(alive) == 3


def test_passkey_accuracy_by_depth_in_the_trials_order():
    trials = [PasskeyTrial(0.5, 1, []), PasskeyTrial(0.0, 2, []), PasskeyTrial(0.5, 3, [])]
    assert passkey_accuracy(trials, [True, False, False]) == {"acc": 1 / 3, "correct": 1,
                                                              "by_depth": {"0.5": 0.5, "0": 0.0}}
    assert passkey_accuracy([], []) == {"acc": None, "correct": 0, "by_depth": {}}
