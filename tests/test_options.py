"""One set of generation options everywhere: GenerationOptions checks every knob once, and `run`,
`chat`, `serve`, `bench`, BitsplitLlama and the server all take every one of them."""

from __future__ import annotations

import dataclasses
import json

import pytest

from bitsplit_llama import GenerationOptions, SamplingParams
from bitsplit_llama.cli import _GEN_PARAMS, main
from bitsplit_llama.errors import InvalidOptionError
from bitsplit_llama.speculative.options import UnknownOptionError

# a value of every option other than its default, valid on any CPU (the kernel family is checked
# against this CPU's only when a model loads)
CHANGED = {
    "n_ctx": 300, "n_batch": 256, "n_threads": 1, "n_gpu_layers": 0, "tree_nodes": 4, "text_nodes": 5, "drafter": "llama.cpp", "draft_stop": 0.25,
    "draft_vocab": "all", "precision": "f32", "act_bits": "16", "kernel": "generic", "rpc": None, "rpc_timeout": 30.0,
    "overlap": False, "overlap_at": "products", "compensation": "cuda", "verbose": False,
}
# the same on the command line (rpc and verbose left out: no server here, and the log is noise)
CHANGED_ARGS = ["--n-ctx", "300", "--n-batch", "256", "-t", "1", "-ngl", "0", "--tree-nodes", "4", "--text-nodes", "5", "--drafter", "llama.cpp",
                "--draft-stop", "0.25", "--draft-vocab", "all", "--precision", "f32", "--act-bits", "16",
                "--kernel", "generic", "--rpc-timeout", "30", "--no-overlap", "--overlap-at", "products",
                "--compensation", "cuda"]
SAMPLING_ARGS = ["--temp", "0.5", "--top-k", "7", "--top-p", "0.9", "--min-p", "0.1", "--seed", "3"]
SAMPLING = SamplingParams(temperature=0.5, top_k=7, top_p=0.9, min_p=0.1, seed=3)


def test_every_field_has_a_changed_value_and_a_cli_option():
    names = set(GenerationOptions.names())
    assert set(CHANGED) == names
    assert {field for field, _, _ in _GEN_PARAMS.values()} == names


def test_defaults_and_normalisation():
    d = GenerationOptions()
    assert (d.n_ctx, d.tree_nodes, d.drafter, d.draft_stop, d.draft_vocab, d.act_bits, d.kernel) == \
        (4096, "auto", "auto", "auto", "auto", "auto", None)
    o = GenerationOptions(tree_nodes="8", draft_stop="off", draft_vocab="2048", n_ctx="512", rpc=["a:1", "b:2"])
    assert (o.tree_nodes, o.draft_stop, o.draft_vocab, o.n_ctx, o.rpc) == (8, None, 2048, 512, "a:1,b:2")
    assert GenerationOptions.from_json(o.to_json()) == o
    assert GenerationOptions.of(o, act_bits="8").act_bits == "8" and o.act_bits == "auto"  # a copy
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.n_ctx = 1  # type: ignore[misc]


@pytest.mark.parametrize("field,value,fragment", [
    ("n_ctx", 4, "--n-ctx: 4 is too small"),
    ("n_ctx", "lots", "--n-ctx: 'lots' is not an integer"),
    ("n_threads", 0, "--threads: 0 is not a positive integer"),
    ("n_gpu_layers", -1, "--n-gpu-layers: -1 is negative"),
    ("tree_nodes", "many", "--tree-nodes: 'many' is neither 'auto'"),
    ("tree_nodes", 999, "--tree-nodes: 999 is more than 256"),
    ("text_nodes", -1, "--text-nodes: -1 is negative"),
    ("text_nodes", 300, "--text-nodes: 300 is more than 256"),
    ("text_nodes", "x", "--text-nodes: 'x' is not an integer"),
    ("drafter", "gpu", "--drafter: 'gpu' is not one of auto, native, llama.cpp"),
    ("overlap_at", "outputs", "--overlap-at: 'outputs' is not one of inputs, products"),
    ("draft_stop", "often", "--draft-stop: 'often'"),
    ("draft_vocab", "-3", "--draft-vocab: '-3' unknown"),
    ("precision", "f8", "--precision: 'f8' is not one of"),
    ("act_bits", "7", "--act-bits: '7' unknown"),
    ("kernel", "avx9", "--kernel: 'avx9' is not a kernel family"),
    ("rpc", "nohost", "--rpc"),
    ("rpc_timeout", 0, "--rpc-timeout: 0"),
])
def test_a_bad_value_is_named(field, value, fragment):
    with pytest.raises(InvalidOptionError, match=fragment.replace("(", r"\(")):
        GenerationOptions(**{field: value})


def test_an_unknown_keyword_is_refused_by_name():
    with pytest.raises(UnknownOptionError, match="'tree_node'") as e:
        GenerationOptions.of(tree_node=4)
    assert isinstance(e.value, TypeError) and isinstance(e.value, InvalidOptionError)
    assert "tree_nodes" in str(e.value)  # the message lists what exists


@pytest.mark.parametrize("command", ["run", "chat", "serve", "bench"])
def test_every_command_takes_every_option(capsys, command):
    assert main([command, "--help"]) == 0
    text = capsys.readouterr().out
    for _, _, opt in _GEN_PARAMS.values():
        for flag in opt.param_decls:
            for f in flag.split("/"):
                assert f in text, f"{command} --help lacks {f}"
    for flag in ("--temp", "--top-k", "--top-p", "--min-p", "--seed"):
        assert flag in text, f"{command} --help lacks {flag}"


@pytest.mark.parametrize("command", ["run", "chat", "serve", "bench"])
@pytest.mark.parametrize("args,fragment", [
    (["--draft-stop", "often"], "--draft-stop: 'often'"),
    (["--act-bits", "7"], "--act-bits: '7' unknown"),
    (["--kernel", "avx9"], "--kernel: 'avx9' is not a kernel family"),
    (["--top-p", "0"], "top-p: 0.0 is outside (0, 1]"),
])
def test_every_command_refuses_a_bad_value_before_loading(capsys, tmp_path, command, args, fragment):
    """Checked in one place, before anything loads: the directory does not even exist."""
    extra = {"run": ["-p", "x"], "bench": ["--vs", str(tmp_path / "q8.gguf")]}.get(command, [])
    code = main([command, str(tmp_path / "nowhere"), *extra, *args])
    err = capsys.readouterr().err
    assert code == 2 and fragment in err, err


def _capture_generator_options(monkeypatch) -> list:
    from bitsplit_llama.speculative import generate

    seen = []
    init = generate.Generator.__init__

    def spy(self, *a, **kw):
        init(self, *a, **kw)
        seen.append(self.options)
    monkeypatch.setattr(generate.Generator, "__init__", spy)
    return seen


def test_run_passes_every_option(capsys, monkeypatch, tiny_split):
    seen = _capture_generator_options(monkeypatch)
    assert main(["run", str(tiny_split), "-p", "the cat", "-n", "4", "--json", *CHANGED_ARGS, *SAMPLING_ARGS]) == 0
    assert seen == [GenerationOptions(**CHANGED)]
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (out["kernel"], out["act_bits"], out["tree_nodes"]) == ("generic", 16, 4)
    assert out["kernel_policy"] == "built-in"  # (the tests' BITSPLIT_POLICY=builtin)


def test_chat_passes_every_option(capsys, monkeypatch, tiny_split):
    seen = _capture_generator_options(monkeypatch)
    calls = []
    from bitsplit_llama.api import llama as api_llama

    cls = api_llama.get_class()
    real = cls.create_chat_completion

    def spy(self, **kw):
        calls.append({k: kw[k] for k in ("temperature", "top_k", "top_p", "min_p", "seed")})
        return real(self, **kw)
    monkeypatch.setattr(cls, "create_chat_completion", spy)
    monkeypatch.setattr("sys.stdin", __import__("io").StringIO("hello\n/exit\n"))
    assert main(["chat", str(tiny_split), "-n", "3", *CHANGED_ARGS, *SAMPLING_ARGS]) == 0
    assert seen == [GenerationOptions(**CHANGED)]
    assert calls == [{"temperature": 0.5, "top_k": 7, "top_p": 0.9, "min_p": 0.1, "seed": 3}]


def test_serve_passes_every_option(monkeypatch, tiny_split):
    from bitsplit_llama.api import server

    got = {}
    monkeypatch.setattr(server, "serve", lambda model_dir, options, **kw: got.update(options=options, **kw))
    assert main(["serve", str(tiny_split), "--port", "8123", *CHANGED_ARGS, *SAMPLING_ARGS]) == 0
    assert got["options"] == GenerationOptions(**CHANGED) and got["sampling"] == SAMPLING and got["port"] == 8123


def test_serve_defaults_come_from_one_place(monkeypatch, tiny_split):
    from bitsplit_llama import api
    from bitsplit_llama.api import server
    from bitsplit_llama.speculative.options import CHAT_TEMPERATURE

    got = {}
    monkeypatch.setattr(server, "serve", lambda model_dir, options, **kw: got.update(options=options, **kw))
    assert main(["serve", str(tiny_split)]) == 0
    assert got["options"] == GenerationOptions()
    assert (got["host"], got["port"], got["queue"], got["wait_s"]) == \
        (api.DEFAULT_HOST, api.DEFAULT_PORT, api.DEFAULT_QUEUE, api.DEFAULT_WAIT_S)
    assert got["sampling"] == SamplingParams(temperature=CHAT_TEMPERATURE)


def test_bench_passes_every_option(capsys, monkeypatch, tiny_split, tiny_f32):
    from bitsplit_llama.tools import bench

    got = {}

    def fake(model_dir, vs, options, **kw):
        got.update(options=options, **kw)
        raise InvalidOptionError("stop here")
    monkeypatch.setattr(bench, "run_bench", fake)
    assert main(["bench", str(tiny_split), "--vs", str(tiny_f32), *CHANGED_ARGS, *SAMPLING_ARGS]) == 2
    assert got["options"] == GenerationOptions(**CHANGED) and got["sampling"] == SAMPLING


def test_bitsplit_llama_takes_every_option(tiny_split):
    from bitsplit_llama import BitsplitLlama

    with BitsplitLlama(tiny_split, **CHANGED) as a:
        assert a.options == GenerationOptions(**CHANGED) and a.kernel == "generic"
    opts = GenerationOptions(**CHANGED)
    with BitsplitLlama(tiny_split, opts, tree_nodes=2) as b:  # keywords override the object's
        assert b.options == opts.replace(tree_nodes=2)
    with pytest.raises(TypeError, match="'act_bit'"):
        BitsplitLlama(tiny_split, act_bit="8")


class _FakeLlm:
    """Stands for a model behind the server: records what a request asked for."""

    def __init__(self):
        self.calls = []
        self.cancel_event = None

    def create_completion(self, prompt, **kw):
        self.calls.append(kw)
        return {"id": "x", "object": "text_completion", "created": 0, "model": "m",
                "choices": [{"text": "", "index": 0, "logprobs": None, "finish_reason": "length"}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 0, "total_tokens": 1}}


def test_server_requests_take_the_servers_sampling_defaults():
    from fastapi.testclient import TestClient

    from bitsplit_llama.api.server import create_app

    llm = _FakeLlm()
    with TestClient(create_app(llm, "m", sampling=SAMPLING)) as c:
        assert c.post("/v1/completions", json={"prompt": "x"}).status_code == 200
        assert c.post("/v1/completions", json={"prompt": "x", "temperature": 0, "top_k": 1}).status_code == 200
    first, second = llm.calls
    assert {k: first[k] for k in ("temperature", "top_k", "top_p", "min_p", "seed")} == \
        {"temperature": 0.5, "top_k": 7, "top_p": 0.9, "min_p": 0.1, "seed": 3}
    assert (second["temperature"], second["top_k"], second["top_p"]) == (0, 1, 0.9)
