"""The `kvcache` command: generate and chat on a tiny model, errors without tracebacks, the console script."""
from __future__ import annotations

import argparse
import contextlib
import io
import os
import shutil
import subprocess
import sys

import pytest

from kvcache import LLM, SamplingParams
from kvcache.cli import build_parser, main

SMALL = ["--kv-cache-memory", "1MiB"]


def _expected_generate(path: str, prompt: str, **params):
    llm = LLM(path, kv_cache_memory="1MiB")
    return llm.generate(prompt, SamplingParams(temperature=0, **params), use_tqdm=False)[0].outputs[0]


def test_generate_prints_text_and_kv_summary(tiny_llama, capsys):
    expected = _expected_generate(tiny_llama, "w5 w6", max_tokens=4, ignore_eos=True)
    assert expected.text  # four word tokens
    rc = main(["generate", "--model", tiny_llama, "--prompt", "w5 w6", "--max-tokens", "4", "--ignore-eos", *SMALL])
    out, err = capsys.readouterr()
    assert rc == 0
    lines = out.splitlines()
    assert lines[0] == expected.text
    assert "[4 tokens, finish_reason=length]" in err
    assert "--- KV cache ---" in out, "the KV summary did not go to stdout"
    summary = out[out.index("--- KV cache ---"):]
    assert "per token : 2 full layers x 2 x 2 kv_heads x 16 head_dim x 4 bytes = 512 bytes/token" in summary
    # 1 MiB / (16 tokens x 512 bytes) = 128 blocks.
    assert "pool      : 128 blocks x 16 tokens = 2,048 tokens" in summary
    assert "this run  : 2 prompt + 4 generated tokens" in summary
    assert "0 blocks held now" in summary


def test_kv_summary_follows_redirected_stdout(tiny_llama):
    """The summary goes to the sys.stdout of the moment, like the generated text does."""
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(["generate", "--model", tiny_llama, "--prompt", "w5 w6", "--max-tokens", "2", *SMALL])
    assert rc == 0
    assert "--- KV cache ---" in buf.getvalue()


def test_generate_default_sampling_is_greedy(tiny_llama, capsys):
    expected = _expected_generate(tiny_llama, "w7 w8 w9", max_tokens=6)
    assert main(["generate", "--model", tiny_llama, "--prompt", "w7 w8 w9", "--max-tokens", "6", *SMALL]) == 0
    out, err = capsys.readouterr()
    assert out.splitlines()[0] == expected.text
    assert f"[{len(expected.token_ids)} tokens, finish_reason={expected.finish_reason}]" in err


def test_generate_several_prompts_and_engine_flags(tiny_llama, capsys):
    rc = main(["generate", "--model", tiny_llama, "--prompt", "w5 w6", "--prompt", "w10 w11 w12", "--max-tokens", "3",
               "--ignore-eos", "--block-size", "8", "--kv-cache-memory", "64KiB", "--max-model-len", "64"])
    out, err = capsys.readouterr()
    assert rc == 0
    assert "=== prompt: 'w5 w6'" in out and "=== prompt: 'w10 w11 w12'" in out
    assert err.count("[3 tokens, finish_reason=length]") == 2
    # 64 KiB / (8 tokens x 512 bytes) = 16 blocks; 64 tokens per request -> 8 blocks -> 2.0 requests.
    assert "pool      : 16 blocks x 8 tokens = 128 tokens" in out
    assert "capacity  : 2.0 requests of max_model_len 64 tokens" in out
    assert "this run  : 5 prompt + 6 generated tokens" in out


def test_generate_with_a_draft_model_prints_its_share(tiny_llama, capsys):
    """Speculation's line and the draft's: 2 MiB for both caches of the same shape, 128 blocks each."""
    expected = _expected_generate(tiny_llama, "w5 w6 w7 w5 w6 w7 w5", max_tokens=12, ignore_eos=True)
    spec = f'{{"model": "{tiny_llama}", "num_speculative_tokens": 3}}'
    rc = main(["generate", "--model", tiny_llama, "--prompt", "w5 w6 w7 w5 w6 w7 w5", "--max-tokens", "12",
               "--ignore-eos", "--kv-cache-memory", "2MiB", "--speculative-config", spec])
    out, _ = capsys.readouterr()
    assert rc == 0 and out.splitlines()[0] == expected.text
    assert "pool      : 128 blocks x 16 tokens" in out
    assert "speculate : " in out and " accepted (" in out
    assert f"draft     : {tiny_llama}: 0.00 GiB of weights, its KV cache 128 blocks = 0.00 GiB" in out


def _assert_one_line_error(rc: int, err: str, *fragments: str) -> None:
    assert rc == 2
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if line.startswith("kvcache: error:")]
    assert len(errors) == 1, err
    for f in fragments:
        assert f in errors[0]


@pytest.mark.parametrize("command", [["generate", "--prompt", "hi"], ["chat", "--message", "hi"]])
def test_bad_model_path_is_a_one_line_error(tmp_path, capsys, command):
    missing = str(tmp_path / "no-such-model")
    rc = main([*command, "--model", missing])
    out, err = capsys.readouterr()
    _assert_one_line_error(rc, err, missing, "does not exist")
    assert out == ""


def test_directory_without_config_is_a_one_line_error(tmp_path, capsys):
    rc = main(["generate", "--model", str(tmp_path), "--prompt", "hi"])
    _assert_one_line_error(rc, capsys.readouterr().err, "config.json")


def test_file_that_is_not_gguf_is_a_one_line_error(tmp_path, capsys):
    bogus = tmp_path / "model.gguf"
    bogus.write_bytes(b"not a gguf file")
    rc = main(["generate", "--model", str(bogus), "--prompt", "hi"])
    _assert_one_line_error(rc, capsys.readouterr().err, "GGUF")


def test_bad_engine_flag_value_is_a_one_line_error(tiny_llama, capsys):
    rc = main(["generate", "--model", tiny_llama, "--prompt", "w5", "--max-model-len", "100000", *SMALL])
    _assert_one_line_error(rc, capsys.readouterr().err, "100,000", "512")
    rc = main(["generate", "--model", tiny_llama, "--prompt", "w5", "--kv-cache-memory", "lots"])
    _assert_one_line_error(rc, capsys.readouterr().err, "'lots'")


def test_prompt_too_long_is_a_one_line_error(tiny_llama, capsys):
    prompt = " ".join(f"w{5 + i % 300}" for i in range(40))
    rc = main(["generate", "--model", tiny_llama, "--prompt", prompt, "--max-model-len", "32", *SMALL])
    _assert_one_line_error(rc, capsys.readouterr().err, "prompt has 40 tokens", "max_model_len is 32")


def test_chat_one_shot(tiny_llama, capsys):
    llm = LLM(tiny_llama, kv_cache_memory="1MiB")
    expected = llm.chat([{"role": "user", "content": "w5 w6"}], SamplingParams(temperature=0, max_tokens=5,
                                                                                ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    assert len(expected.token_ids) == 5 and expected.text
    rc = main(["chat", "--model", tiny_llama, "--message", "w5 w6", "--max-tokens", "5", "--ignore-eos", *SMALL])
    out, err = capsys.readouterr()
    assert rc == 0
    lines = out.splitlines()
    assert lines[0] == expected.text
    assert "kvcache chat:" not in out  # no interactive banner in one-shot mode
    assert "--- KV cache ---" in out
    # The chat template wraps "w5 w6": "user w5 w6 w3" is 4 tokens.
    assert "this run  : 4 prompt + 5 generated tokens" in out
    assert "0 blocks held now" in out


def test_chat_one_shot_with_system_prompt(tiny_llama, capsys):
    llm = LLM(tiny_llama, kv_cache_memory="1MiB")
    messages = [{"role": "system", "content": "w9"}, {"role": "user", "content": "w5 w6"}]
    expected = llm.chat(messages, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    rc = main(["chat", "--model", tiny_llama, "--system", "w9", "--message", "w5 w6", "--max-tokens", "3",
               "--ignore-eos", *SMALL])
    out, _ = capsys.readouterr()
    assert rc == 0
    assert out.splitlines()[0] == expected.text
    assert "this run  : 6 prompt + 3 generated tokens" in out


def _console_script() -> str:
    script = os.path.join(os.path.dirname(sys.executable), "kvcache")
    if not os.path.exists(script):
        script = shutil.which("kvcache")
    assert script, "the kvcache console script is not installed"
    return script


def test_console_script_help():
    r = subprocess.run([_console_script(), "--help"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("usage: kvcache")
    for sub in ("generate", "chat", "bench"):
        assert sub in r.stdout


def test_console_script_generate_help_lists_vllm_flags():
    r = subprocess.run([_console_script(), "generate", "--help"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    for flag in ("--model", "--block-size", "--max-num-seqs", "--max-num-batched-tokens", "--max-model-len",
                 "--kv-cache-memory", "--gpu-memory-utilization", "--max-tokens", "--temperature", "--stop"):
        assert flag in r.stdout


def test_console_script_runs_generate(tiny_llama):
    r = subprocess.run([_console_script(), "generate", "--model", tiny_llama, "--prompt", "w5 w6", "--max-tokens", "2",
                        "--ignore-eos", *SMALL], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "--- KV cache ---" in r.stdout
    assert "[2 tokens, finish_reason=length]" in r.stderr
    assert "Traceback" not in r.stderr


def test_console_script_error_exit_code(tmp_path):
    r = subprocess.run([_console_script(), "generate", "--model", str(tmp_path / "nope"), "--prompt", "x"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "kvcache: error:" in r.stderr and "Traceback" not in r.stderr


def test_missing_subcommand_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        main([])
    assert e.value.code == 2
    assert "usage: kvcache" in capsys.readouterr().err


# ---- every flag's help says what it does and its default ----

def _parsers(parser: argparse.ArgumentParser, path: tuple[str, ...] = ("kvcache",)):
    """(path, parser) of `parser` and of every subcommand under it, nested ones (bench, eval) included."""
    yield " ".join(path), parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, (*path, name))


def help_gaps(parser: argparse.ArgumentParser) -> list[str]:
    """The flags of `parser` with no help, or whose default (other than None or False) the help does not tell."""
    gaps = []
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        name = "/".join(action.option_strings) or action.dest
        if not action.help or action.help == argparse.SUPPRESS or not action.help.strip():
            gaps.append(f"{name}: no help")
        elif action.default is not None and action.default is not False:
            shown = parser._get_formatter()._expand_help(action)  # as --help prints it, %(default)s filled in
            if "default" not in shown.lower():
                gaps.append(f"{name}: its default {action.default!r} is not in its help")
    return gaps


PARSERS = dict(_parsers(build_parser()))


@pytest.mark.parametrize("command", sorted(PARSERS))
def test_every_flag_has_help_telling_its_default(command):
    assert not help_gaps(PARSERS[command]), f"`{command}`: " + "; ".join(help_gaps(PARSERS[command]))


def test_help_walk_covers_every_subcommand():
    for command in ("kvcache generate", "kvcache chat", "kvcache plan", "kvcache simulate", "kvcache serve",
                    "kvcache top", "kvcache bench throughput", "kvcache bench kv-page", "kvcache eval weights"):
        assert command in PARSERS


def test_help_gaps_finds_a_flag_without_help():
    p = argparse.ArgumentParser()
    p.add_argument("--quiet", action="store_true", help="say less")
    p.add_argument("--n", type=int, default=3, help="how many")
    p.add_argument("--m", type=int, default=3)
    assert help_gaps(p) == ["--n: its default 3 is not in its help", "--m: no help"]


def test_seed_and_sample_seed_are_told_apart():
    """--seed is the engine's (eviction's random generator), --sample-seed the sampler's: each help names the other."""
    actions = {a.dest: a for a in PARSERS["kvcache generate"]._actions}
    assert "--sample-seed" in actions["seed"].help and "sampl" in actions["seed"].help
    assert "--seed" in actions["sample_seed"].help and "sampl" in actions["sample_seed"].help
