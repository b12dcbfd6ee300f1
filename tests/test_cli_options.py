"""The command line a Mac user expects (issue 13): mlx-lm's options and
names, the built-in pair by name, one clear sentence per mistake, stats that
say what happened, the context length, prompt-cache files."""

from __future__ import annotations

import json
import shutil

import mlx.core as mx
import pytest
from cli_fixtures import make_tiny_pair
from mlx.utils import tree_flatten
from test_cli import assert_user_error
from typer.testing import CliRunner

import dflash_mlx
from dflash_mlx.cli.app import app
from dflash_mlx.prompts import apply_chat_template

runner = CliRunner()
COMMANDS = ["generate", "chat", "bench", "models", "serve", "convert", "train", "doctor", "cache-prompt", "version"]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_tiny_pair(tmp_path_factory.mktemp("cli-options"))


@pytest.fixture(scope="module")
def loaded(pair):
    return {
        "raw": dflash_mlx.load(str(pair.target), draft=str(pair.draft)),
        "chat": dflash_mlx.load(str(pair.chat_target), draft=str(pair.draft)),
    }


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def run(*args, input=None):
    return runner.invoke(app, [str(a) for a in args], input=input, prog_name="dflash-mlx", env={"COLUMNS": "200"})


def gen(pair, *args, target=None, input=None):
    return run("generate", "--model", target or pair.target, "--draft-model", pair.draft, *args, input=input)


# -- names ----------------------------------------------------------------------------
@pytest.mark.parametrize("command", COMMANDS)
def test_help_h_examples_no_bool_metavar_and_the_builtin_pair(command):
    result = run(command, "-h")
    assert result.exit_code == 0, result.output
    assert "Example" in result.output and f"dflash-mlx {command}" in result.output
    assert "<bool>" not in result.output
    if "--model" in result.output:
        assert "built-in" in " ".join(result.output.split())


def test_version_flag_and_root_help():
    assert run("--version").stdout.strip() == dflash_mlx.__version__
    root = run("-h")
    assert root.exit_code == 0 and "<bool>" not in root.output and "built-in pair" in root.output


def test_m_is_max_tokens_everywhere():
    for command in ("generate", "chat", "bench", "serve"):
        out = run(command, "-h").output
        assert "--max-tokens" in out and " -m " in out
    train = run("train", "-h").output
    assert " -m " not in train and "--model" in train


def test_a_flag_shared_by_commands_means_the_same_in_each():
    """One definition a flag: its names, help, type and callback agree on every
    command that samples or loads a pair; only the defaults below differ."""
    import typer.main

    commands = typer.main.get_command(app).commands
    own = {("cache-prompt", "prompt"), ("cache-prompt", "prompt_cache_file")}
    seen = {}
    for name in ("generate", "chat", "bench", "serve", "cache-prompt"):
        for p in commands[name].params:
            if (name, p.name) in own:
                continue
            meaning = (
                tuple(p.opts),
                p.help,
                p.type_descriptor.annotation,
                p.is_flag,
                getattr(p.callback, "__wrapped__", None),
            )
            assert seen.setdefault(p.opts[0], meaning) == meaning, (name, p.opts[0])
    defaults = {name: {p.name: p.default for p in commands[name].params} for name in ("generate", "chat", "bench")}
    assert [defaults[n]["max_tokens"] for n in defaults] == [256, 512, 256]
    assert [defaults[n]["seed"] for n in defaults] == [None, None, 0]


def test_model_builtin_by_name(pair):
    named = run("generate", "--model", "builtin", "--prompt", "def add(a, b):", "--ignore-chat-template", "-m", 8)
    default = run("generate", "--prompt", "def add(a, b):", "--ignore-chat-template", "-m", 8)
    assert named.exit_code == 0 and named.stdout == default.stdout
    assert "downloading" not in named.output.lower() and "no --model given" not in named.stderr


def test_train_without_model_uses_the_builtin_target_and_one_error_style(tmp_path):
    result = run("train", "--data", tmp_path / "missing.jsonl", "--out", tmp_path / "out")
    assert "no --model given: using the" in result.stderr
    assert_user_error(result, "the prompts file", "does not exist")
    assert not (tmp_path / "out").exists()


# -- mlx-lm's options ----------------------------------------------------------------
def test_num_draft_tokens_is_block_size_plus_one(pair):
    by_drafts = gen(pair, "--prompt", "w1 w2", "-m", 20, "--num-draft-tokens", 3)
    by_block = gen(pair, "--prompt", "w1 w2", "-m", 20, "--block-size", 4)
    assert by_drafts.exit_code == 0 and by_drafts.stdout == by_block.stdout
    assert "block 4" in by_drafts.stderr
    assert_user_error(gen(pair, "--prompt", "w1", "--num-draft-tokens", 3, "--block-size", 4), "not both")
    assert_user_error(
        gen(pair, "--prompt", "w1", "--num-draft-tokens", 0), "--num-draft-tokens must be a positive integer"
    )


def test_a_block_past_the_trained_one_is_one_sentence(pair):
    assert_user_error(
        gen(pair, "--prompt", "w1", "--block-size", 999),
        "--block-size 999 is larger than the block the drafter was trained for (6)",
    )
    assert_user_error(gen(pair, "--prompt", "w1", "--num-draft-tokens", 9), "--block-size 10 is larger")


def test_min_p_is_checked(pair):
    assert_user_error(gen(pair, "--prompt", "w1", "--min-p", 1.5), "--min-p must be in [0, 1]")


def test_min_p_filters_as_mlx_lm_does():
    from mlx_lm.sample_utils import apply_min_p

    from dflash_mlx.decode.sampling import SamplingParams, target_logprobs

    logits = mx.random.normal((3, 40), key=mx.random.key(0)) * 3
    ours = target_logprobs(logits, SamplingParams(1.0, min_p=0.1))
    ref = apply_min_p(logits - mx.logsumexp(logits, axis=-1, keepdims=True), 0.1)
    assert mx.array_equal(mx.isinf(ours), mx.isinf(ref)).item()
    assert mx.allclose(mx.where(mx.isinf(ref), 0, ours), mx.where(mx.isinf(ref), 0, ref)).item()


def test_extra_eos_token_ends_the_reply(pair, loaded):
    model, draft, tok = loaded["raw"]
    free = dflash_mlx.generate(model, draft, tok, "w1 w2", max_tokens=30).split()
    stop = free[3]
    result = gen(pair, "--prompt", "w1 w2", "-m", 30, "--extra-eos-token", stop)
    assert result.exit_code == 0, result.output
    assert result.stdout.split() == free[: free.index(stop)]
    assert_user_error(
        gen(pair, "--prompt", "w1", "--extra-eos-token", "<nonsense>"), "--extra-eos-token '<nonsense>' is not a token"
    )


def test_prefill_response_and_template_config(pair, loaded):
    model, draft, tok = loaded["chat"]
    ids = apply_chat_template(tok, [{"role": "user", "content": "w7"}], prefill="w9 w10")
    want = dflash_mlx.generate(model, draft, tok, ids, max_tokens=10)
    result = gen(pair, "--prompt", "w7", "--prefill-response", "w9 w10", "-m", 10, target=pair.chat_target)
    assert result.exit_code == 0 and result.stdout == want + "\n"
    # --chat-template-config (alias --chat-template-args) reaches the template like --enable-thinking
    thinking = gen(pair, "--prompt", "w7", "-m", 10, "--enable-thinking", target=pair.chat_target)
    for flag in ("--chat-template-config", "--chat-template-args"):
        configured = gen(pair, "--prompt", "w7", "-m", 10, flag, '{"enable_thinking": true}', target=pair.chat_target)
        assert configured.exit_code == 0 and configured.stdout == thinking.stdout
    assert_user_error(
        gen(pair, "--prompt", "w7", "--chat-template-config", "{bad", target=pair.chat_target), "is not valid JSON"
    )
    assert_user_error(
        gen(pair, "--prompt", "w7", "--chat-template-config", "[1]", target=pair.chat_target), "must be a JSON object"
    )


def test_adapter_path_applies_lora_to_the_target(pair, tmp_path):
    from mlx_lm.tuner.utils import linear_to_lora_layers

    model, draft, tok = dflash_mlx.load(str(pair.target), draft=str(pair.draft))
    lora = {"rank": 4, "scale": 20.0, "dropout": 0.0, "keys": ["self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj"]}
    linear_to_lora_layers(model, 2, lora)
    adapters = {
        k: mx.random.normal(v.shape, key=mx.random.key(i)) * 0.5
        for i, (k, v) in enumerate(tree_flatten(model.trainable_parameters()))
        if k.endswith(("lora_a", "lora_b"))
    }
    out = tmp_path / "adapters"
    out.mkdir()
    mx.save_safetensors(str(out / "adapters.safetensors"), adapters)
    (out / "adapter_config.json").write_text(
        json.dumps({"fine_tune_type": "lora", "num_layers": 2, "lora_parameters": lora})
    )

    tuned = dflash_mlx.load(str(pair.target), draft=str(pair.draft), adapter_path=str(out))
    want = dflash_mlx.generate(*tuned, "w1 w2 w3", max_tokens=20)
    result = gen(pair, "--prompt", "w1 w2 w3", "-m", 20, "--adapter-path", out, "--trust-remote-code")
    assert result.exit_code == 0, result.output
    assert result.stdout == want + "\n"
    assert want != dflash_mlx.generate(
        *dflash_mlx.load(str(pair.target), draft=str(pair.draft)), "w1 w2 w3", max_tokens=20
    )
    assert_user_error(
        gen(pair, "--prompt", "w1", "--adapter-path", tmp_path / "none"), "the adapter path", "does not exist"
    )


# -- messages ---------------------------------------------------------------------------
def test_mistakes_are_one_clear_sentence(pair, tmp_path):
    assert_user_error(gen(pair, "--prompt", "-", input=b"w1 \xff\xfe w2\n"), "the prompt on stdin is not UTF-8 text")
    assert_user_error(
        gen(pair, "--prompt", "w1", target=pair.draft), "is a DFlash drafter, not a target model", "--draft-model"
    )
    (tmp_path / "notes").mkdir()
    assert_user_error(run("generate", "--model", tmp_path / "notes", "--prompt", "w1"), "is not a model directory")
    typo = run("generate", "--model", "./qwen3-8b", "--prompt", "w1")
    assert_user_error(typo, "./qwen3-8b does not exist; check the path")
    assert "download" not in typo.output.lower()
    # a family no adapter serves is refused before the drafter (a Hub repo, not cached, offline) is fetched
    mamba = tmp_path / "mamba"
    shutil.copytree(pair.target, mamba)
    cfg = json.loads((mamba / "config.json").read_text())
    (mamba / "config.json").write_text(json.dumps({**cfg, "model_type": "mamba"}))
    assert_user_error(
        run("generate", "--model", mamba, "--draft-model", "z-lab/Qwen3-8B-DFlash-b16", "--prompt", "w1"),
        "target model type 'mamba' is not supported yet",
    )
    # an unknown target without --draft-model: the flag, not the Python keyword, and no list of pairs on one line
    unknown = run("generate", "--model", pair.target, "--prompt", "w1")
    assert_user_error(unknown, "no known DFlash drafter", "--draft-model", "dflash-mlx models")
    assert "draft=" not in unknown.stderr


def test_a_seed_may_be_negative(pair, loaded):
    result = gen(pair, "--prompt", "w1", "-m", 8, "--temp", 0.7, "--seed", -1)
    assert result.exit_code == 0, result.output
    model, draft, tok = loaded["raw"]
    assert result.stdout == dflash_mlx.generate(model, draft, tok, "w1", max_tokens=8, temperature=0.7, seed=-1) + "\n"


# -- stats and small things -------------------------------------------------------------
def test_stats_name_the_block_the_cut_and_no_first_token_rate(pair):
    fixed = gen(pair, "--prompt", "w1 w2", "-m", 12, "--block-size", 4)
    stats = " ".join(fixed.stderr.split())
    assert "block 4" in stats and "cut at --max-tokens 12" in stats
    auto = " ".join(gen(pair, "--prompt", "w1 w2", "-m", 12).stderr.split())
    assert "block auto " in auto  # with what auto chose, e.g. "block auto 4-6, mostly 6"
    one = " ".join(gen(pair, "--prompt", "w1 w2", "-m", 1).stderr.split())
    assert "generated 1 token ·" in one and "generated 1 token, " not in one  # no rate for the first token alone


def test_status_block_text():
    from types import SimpleNamespace

    from dflash_mlx.cli.status import block_text

    r = SimpleNamespace(block_sizes={8: 2, 16: 5, 1: 3})
    assert block_text(r, "auto") == "block auto 8-16, mostly 16, 3 plain steps"
    assert block_text(SimpleNamespace(block_sizes={6: 4}), None) == "block auto 6"
    assert block_text(SimpleNamespace(block_sizes={4: 4, 1: 1}), 4) == "block 4, 1 plain step"


def test_generation_stops_at_the_context_length(pair, tmp_path, loaded):
    short = tmp_path / "short-context"
    shutil.copytree(pair.target, short)
    cfg = json.loads((short / "config.json").read_text())
    (short / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": 20}))
    result = gen(pair, "--prompt", "w1 w2 w3", "-m", 100, target=short)
    assert result.exit_code == 0, result.output
    model, draft, tok = loaded["raw"]
    assert result.stdout == dflash_mlx.generate(model, draft, tok, "w1 w2 w3", max_tokens=17) + "\n"
    assert "cut at the target's context length (20 positions)" in " ".join(result.stderr.split())
    assert "stopped at the target's context length" in result.stderr
    assert_user_error(
        gen(pair, "--prompt", " ".join(["w1"] * 30), target=short), "fills the target's context of 20 positions"
    )
    chat = run("chat", "--model", short, "--draft-model", pair.draft, "-m", 100, input="w1 w2 w3\nw4\n")
    assert chat.exit_code == 0 and "reached the target's context length" in chat.stdout


def test_prompt_lines_opening_with_a_brace(tmp_path):
    from dflash_mlx.prompts import read_prompts

    path = tmp_path / "p.txt"
    path.write_text('{a, b} is a set literal\n{"prompt": "w1"}\n{"turns": ["w1", "w2"]}\n')
    assert read_prompts(path) == [
        {"prompt": "{a, b} is a set literal"},
        {"prompt": "w1"},
        {"prompt": "w1", "turns": ["w1", "w2"]},
    ]


# -- prompt-cache files ---------------------------------------------------------------------
def test_cache_prompt_then_generate_decodes_the_uncached_prompt(pair, tmp_path, loaded):
    doc = " ".join(f"w{i % 50 + 6}" for i in range(80)) + " "  # the question follows it
    path = tmp_path / "doc.safetensors"
    made = run(
        "cache-prompt",
        "--model",
        pair.chat_target,
        "--draft-model",
        pair.draft,
        "--prompt",
        doc,
        "--system-prompt",
        "w9",
        "--prompt-cache-file",
        path,
    )
    assert made.exit_code == 0, made.output
    assert "cached" in made.stdout and path.is_file()
    for question in ("w7 w8", "w11"):
        result = gen(pair, "--prompt-cache-file", path, "--prompt", question, "-m", 16, target=pair.chat_target)
        assert result.exit_code == 0, result.output
        uncached = gen(pair, "--system-prompt", "w9", "--prompt", doc + question, "-m", 16, target=pair.chat_target)
        assert result.stdout == uncached.stdout
        assert "shares only" not in result.stderr
    # chat continues the cached prefix the same way
    chat = run(
        "chat",
        "--model",
        pair.chat_target,
        "--draft-model",
        pair.draft,
        "-m",
        16,
        "--prompt-cache-file",
        path,
        input="w7 w8\n",
    )
    first = gen(
        pair, "--prompt-cache-file", path, "--prompt", "w7 w8", "-m", 16, target=pair.chat_target
    ).stdout.strip()
    assert chat.exit_code == 0 and first in chat.stdout
    # the built-in pair's file is refused by the tiny pair, in one sentence
    builtin_file = tmp_path / "builtin.safetensors"
    assert run("cache-prompt", "--prompt", "import os", "--prompt-cache-file", builtin_file).exit_code == 0
    assert_user_error(
        gen(pair, "--prompt-cache-file", builtin_file, "--prompt", "w1"), "was made for another model pair (builtin)"
    )
    assert_user_error(
        gen(pair, "--prompt-cache-file", tmp_path / "none.safetensors", "--prompt", "w1"), "does not exist"
    )
    assert_user_error(run("cache-prompt", "--prompt", "x"), "no --prompt-cache-file given")


def test_converted_directories_get_the_usual_mode(pair, tmp_path):
    import os
    import stat

    mask = os.umask(0o022)
    try:
        result = run("convert", "--hf-path", pair.draft, "--mlx-path", tmp_path / "converted")
    finally:
        os.umask(mask)
    assert result.exit_code == 0, result.output
    assert stat.S_IMODE((tmp_path / "converted").stat().st_mode) == 0o755


def test_readme_python_example_on_the_builtin_pair_prints_a_haiku():
    from dflash_mlx import load, stream_generate

    model, draft, tokenizer = load("builtin")
    messages = [{"role": "user", "content": "Write a haiku about MLX."}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    text = "".join(
        r.text
        for r in stream_generate(model, draft, tokenizer, prompt, max_tokens=128, temperature=0.7, top_p=0.95, seed=0)
    )
    assert text.strip()


# -- chat: multi-line input, /save and --resume (the pty test drives a real terminal) ----------
def chat(pair, *flags, input, target=None):
    return run("chat", "--model", target or pair.target, "--draft-model", pair.draft, "-m", 10, *flags, input=input)


def test_chat_backslash_continues_a_message(pair, loaded):
    model, draft, tok = loaded["raw"]
    result = chat(pair, input="w1 w2\\\nw3\n")
    assert result.exit_code == 0, result.output
    assert result.stdout.count("── ") == 1  # one turn
    assert dflash_mlx.generate(model, draft, tok, "w1 w2\nw3", max_tokens=10) in result.stdout


@pytest.mark.parametrize("kind", ["raw", "chat"])
def test_chat_save_and_resume(pair, tmp_path, kind):
    target = pair.target if kind == "raw" else pair.chat_target
    whole = chat(pair, input="w1 w2 w3\nw4 w5\n", target=target)
    second = whole.stdout.split("── ")[1].split("\n", 1)[1]  # the second reply, after the first status line
    saved = tmp_path / "talk.json"
    first = chat(pair, input=f"w1 w2 w3\n/save {saved}\n", target=target)
    assert first.exit_code == 0 and f"chat --resume {saved}" in first.stdout
    data = json.loads(saved.read_text())
    assert [m["role"] for m in data["messages"]] == ["user", "assistant"]
    resumed = chat(pair, "--resume", saved, input="w4 w5\n", target=target)
    assert resumed.exit_code == 0, resumed.output
    assert "resumed 1 turn" in resumed.stdout
    assert second.split("── ")[0].strip() in resumed.stdout.split("resumed 1 turn")[1]
    assert_user_error(chat(pair, "--resume", tmp_path / "none.json", input=""), "does not exist")
    (tmp_path / "bad.json").write_text('{"messages": [{"role": "robot"}]}')
    assert_user_error(chat(pair, "--resume", tmp_path / "bad.json", input=""), "no list of messages")


def test_min_p_reaches_the_reply(pair, loaded):
    model, draft, tok = loaded["raw"]
    args = dict(max_tokens=24, temperature=1.5, seed=3)
    result = gen(pair, "--prompt", "w1 w2", "-m", 24, "--temp", 1.5, "--min-p", 0.3, "--seed", 3)
    assert result.exit_code == 0, result.output
    want = dflash_mlx.generate(model, draft, tok, "w1 w2", min_p=0.3, **args)
    assert result.stdout == want + "\n"
    assert want != dflash_mlx.generate(model, draft, tok, "w1 w2", **args)  # the filter changed the sample
    # the seeded text is the same at every block size (the target's own draws, filtered by min-p)
    assert want == dflash_mlx.generate(model, draft, tok, "w1 w2", min_p=0.3, block_size=2, **args)


def test_bench_takes_min_p_and_num_draft_tokens(pair):
    result = run(
        "bench",
        "--model",
        pair.target,
        "--draft-model",
        pair.draft,
        "-m",
        6,
        "--min-p",
        0.2,
        "--temp",
        0.8,
        "--num-draft-tokens",
        3,
        "--json",
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["min_p"] == 0.2 and data["block_size"] == 4
