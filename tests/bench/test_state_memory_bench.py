import argparse
import json

import pytest

from kvcache.bench import state_memory


def test_the_engine_holds_what_the_planner_counts_for_every_kind_of_layer(tmp_path):
    p = argparse.ArgumentParser()
    state_memory.add_args(p)
    out, png = tmp_path / "sm.json", tmp_path / "sm.png"
    args = p.parse_args(["--lengths", "64,300", "--plan-lengths", "64,256,1024", "--window", "64",
                         "--json", str(out), "--plot", str(png)])
    assert state_memory.run(args) == 0  # within 5% everywhere
    r = json.loads(out.read_text())["shapes"]
    assert list(r) == list(state_memory.SHAPES) and png.stat().st_size > 0
    for shape, v in r.items():
        assert [e["engine_bytes"] for e in v["engine"]] == [e["planner_bytes"] for e in v["engine"]], shape
    plan = {s: [v["planner"][str(n)] for n in (64, 256, 1024)] for s, v in r.items()}
    assert plan["mamba2"][0] == plan["mamba2"][2] > 0  # a state of fixed size
    assert plan["mistral"][1] == plan["mistral"][2] < plan["llama"][2]  # a window's worth, however long
    grows = {s: plan[s][2] - plan[s][1] for s in ("llama", "deepseek_v2", "bamba")}
    assert grows["llama"] > grows["deepseek_v2"] > grows["bamba"] > 0  # MLA's latent, then 2 attention layers of 8
    assert grows["bamba"] * 4 == grows["llama"]
    assert plan["bamba"][0] > plan["llama"][0] / 4  # its state on top


def test_bad_shapes_are_refused():
    p = argparse.ArgumentParser()
    state_memory.add_args(p)
    with pytest.raises(ValueError, match="--shapes takes llama"):
        state_memory.run(p.parse_args(["--shapes", "gpt2"]))
