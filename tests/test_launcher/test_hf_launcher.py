"""Hugging Face input through `python -m launcher`: each kind of bad input exits 2 with one error
line naming the key, no traceback, and nothing written to the output directory; a hub id
resolves from the hub's local cache with HF_HUB_OFFLINE=1 (nothing downloads). The launches of
this module run at once (a module fixture), each test reads its own."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.launch import child_env, kill_tree, launcher_cmd

SNAPSHOT = "0123456789abcdef0123456789abcdef01234567"


def hub_cache(assets, root: Path) -> Path:
    """A Hugging Face Hub cache holding the tiny Llama as `tiny-org/tiny-llama` (its layout:
    refs/main names a snapshot directory holding the files)."""
    repo = root / "hub" / "models--tiny-org--tiny-llama"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(SNAPSHOT)
    shutil.copytree(assets.llama, repo / "snapshots" / SNAPSHOT)
    return root / "hub"


pytest.importorskip("transformers")


def _cases(assets, root: Path) -> dict[str, tuple[list[str], str]]:
    """name: (overrides, the start of the error message)."""
    no_config = root / "no_config"
    no_config.mkdir()
    pickled = root / "pickled"
    shutil.copytree(assets.llama, pickled)
    (pickled / "model.safetensors").rename(pickled / "pytorch_model.bin")
    custom = root / "custom"
    shutil.copytree(assets.llama, custom)
    config = json.loads((custom / "config.json").read_text())
    config.update(model_type="my-llama", auto_map={"AutoConfig": "configuration_my.MyConfig"})
    (custom / "config.json").write_text(json.dumps(config))
    small = root / "small_vocab"
    shutil.copytree(assets.gpt2, small)
    config = json.loads((small / "config.json").read_text())
    config["vocab_size"] = 300
    (small / "config.json").write_text(json.dumps(config))
    no_assistant = root / "no_assistant.jsonl"
    no_assistant.write_text(
        json.dumps({"messages": [{"role": "user", "content": "only a question"}]}) + "\n"
    )
    plain = root / "plain_tokenizer"
    shutil.copytree(assets.tokenizer, plain)
    (plain / "chat_template.jinja").unlink()
    chat = ["--data.format", "chat", "--data.source"]
    return {
        "missing_dir": ([], f"model.name: no such directory '{root / 'missing'}'"),
        "no_config": ([], f"model.name: {no_config} has no config.json"),
        "pickle_only": ([], f"model.pretrained: {pickled} holds weights only as pickle"),
        "remote_code": ([], f"model.trust_remote_code: {custom} needs the Python code"),
        "vocab": ([], f"data.tokenizer: hf:{assets.tokenizer} produces ids up to"),
        "no_assistant": ([*chat, str(no_assistant)], "data.source: no usable chat row"),
        "no_template": (
            [*chat, str(assets.chat), "--data.tokenizer", f"hf:{plain}"],
            "data.chat_template:",
        ),
        "hub_id": (["--data.tokenizer", "hf:tiny-org/tiny-llama", "--train.max_steps", "2"], ""),
    }, {
        "missing_dir": root / "missing",
        "no_config": no_config,
        "pickle_only": pickled,
        "remote_code": custom,
        "vocab": small,
        "no_assistant": assets.llama,
        "no_template": assets.llama,
        "hub_id": "tiny-org/tiny-llama",
    }


@pytest.fixture(scope="module")
def outcomes(hf_assets, tmp_path_factory) -> dict[str, tuple[int, str, Path, str]]:
    root = tmp_path_factory.mktemp("bad_input")
    cases, models = _cases(hf_assets, root)
    procs = {}
    for name, (overrides, _) in cases.items():
        run_dir = root / f"run_{name}"
        args = [
            "--run.output_dir",
            str(run_dir),
            "--train.progress_bar",
            "never",
            "--model.name",
            f"hf:{models[name]}",
            "--data.tokenizer",
            f"hf:{hf_assets.tokenizer}",
            "--data.source",
            str(hf_assets.text),
            *overrides,
        ]
        env = child_env(
            {
                "HF_DATASETS_CACHE": str(root / "cache"),
                "HF_HUB_OFFLINE": "1",
                "HF_HUB_CACHE": str(hub_cache(hf_assets, root / name)),
            }
        )
        procs[name] = (
            subprocess.Popen(
                launcher_cmd(None, args),
                cwd=root,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
            ),
            run_dir,
        )
    out = {}
    for name, (proc, run_dir) in procs.items():
        try:
            text, _ = proc.communicate(timeout=240)
        finally:
            if proc.poll() is None:
                kill_tree(proc)
        out[name] = (proc.returncode, text, run_dir, cases[name][1])
    return out


def check(outcome: tuple[int, str, Path, str]) -> None:
    code, text, run_dir, expected = outcome
    assert code == 2, text
    assert "Traceback" not in text, text
    errors = [line for line in text.splitlines() if " ERROR " in line]
    assert len(errors) == 1, text
    assert errors[0].split(" ERROR launcher: ", 1)[1].startswith(expected), errors[0]
    assert not run_dir.exists()


def test_missing_model_directory(outcomes):
    check(outcomes["missing_dir"])


def test_directory_without_config_json(outcomes):
    check(outcomes["no_config"])


def test_pickle_only_weights(outcomes):
    text = outcomes["pickle_only"][1]
    check(outcomes["pickle_only"])
    assert "save_pretrained" in text  # says how to convert them


def test_model_that_needs_trust_remote_code(outcomes):
    check(outcomes["remote_code"])


def test_tokenizer_larger_than_the_embedding_names_both_sizes(outcomes):
    check(outcomes["vocab"])
    assert "embedding of 300 rows" in outcomes["vocab"][1]


def test_chat_rows_without_an_assistant_turn(outcomes):
    check(outcomes["no_assistant"])
    assert "1 with no assistant turn" in outcomes["no_assistant"][1]


def test_tokenizer_without_a_chat_template(outcomes):
    check(outcomes["no_template"])


def test_a_hub_id_trains_from_the_hub_cache_offline(outcomes):
    code, text, run_dir, _ = outcomes["hub_id"]
    assert code == 0, text
    assert "LlamaForCausalLM" in text and (run_dir / "checkpoint-2" / "hf.json").is_file()
