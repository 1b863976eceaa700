"""Hub integration: model cards, save/push with the card, research-checkpoint (EAGLE/HASS/PosS) conversion."""

import json
import math
import os
import re

import pytest
import torch
import yaml
from huggingface_hub import ModelCard
from safetensors.torch import load_file, save_file

from tiny_models import prompts, tiny_target
from transformers_poss import PosSConfig, PosSDrafter
from transformers_poss import cli, hub
from transformers_poss.checkpoints import research as research_checkpoint

VOCAB = 96


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama", vocab_size=VOCAB)


def _front_matter(text: str) -> dict:
    match = re.match(r"^---\n(.*?)\n---\n", text, re.S)
    assert match, "card has no YAML front matter"
    return yaml.safe_load(match.group(1))


def _benchmark():
    return {
        "results": [
            {"dataset": "mt_bench", "method": "poss", "tokens_per_s": 40.5, "speedup": 1.83,
             "mean_acceptance_length": 2.91, "position_acceptance": [0.74, 0.61, float("nan")]},
            {"dataset": "gsm8k", "method": "poss-chain", "tokens_per_s": 35.0, "speedup": 1.52,
             "mean_acceptance_length": 2.4, "position_acceptance": [0.7, None]},
            {"dataset": "mt_bench", "method": "plain", "tokens_per_s": 22.1, "speedup": 1.0,
             "mean_acceptance_length": None, "position_acceptance": []},
        ],
        "environment": {"device": "cpu", "dtype": "bfloat16", "threads": 2},
    }


# ---- cards --------------------------------------------------------------------------------------------------------
def test_card_metadata_and_model_index_round_trip(target):
    drafter = PosSDrafter.from_target(target, num_specialists=2, positions_per_specialist=3,
                                      target_name_or_path="org/tiny-target")
    drafter.training_record = {"data": "sharegpt 68k", "steps": 1200, "tokens": 345678}
    text = str(hub.render_card(drafter, _benchmark(), model_id="me/tiny-poss", license="mit"))
    meta = _front_matter(text)
    assert meta["library_name"] == "transformers-poss"
    assert meta["base_model"] == "org/tiny-target"
    assert "speculative-decoding" in meta["tags"]
    assert meta["license"] == "mit" and meta["pipeline_tag"] == "text-generation"
    index = meta["model-index"][0]["results"]
    results = {r["dataset"]["name"]: {m["type"]: m["value"] for m in r["metrics"]} for r in index}
    assert results == {"mt_bench": {"mean_acceptance_length": 2.91, "speedup": 1.83},
                       "gsm8k": {"mean_acceptance_length": 2.4, "speedup": 1.52}}  # the "plain" row is not ours
    parsed = ModelCard(text).data  # huggingface_hub's own parser accepts the metadata
    assert {(e.dataset_name, e.metric_type) for e in parsed.eval_results} == {
        ("mt_bench", "mean_acceptance_length"), ("mt_bench", "speedup"), ("gsm8k", "mean_acceptance_length"),
        ("gsm8k", "speedup")}
    body = text.split("---", 2)[2]
    assert 'PosSDrafter.from_pretrained("me/tiny-poss")' in body and 'target_id = "org/tiny-target"' in body
    assert "| Specialists (`num_specialists`) | 2 |" in body
    assert "| Positions per specialist (`positions_per_specialist`, the k of PosS-k) | 3 |" in body
    assert "| steps | 1200 |" in body and "| tokens | 345678 |" in body and "| data | sharegpt 68k |" in body
    assert "| mt_bench | poss | 40.5 | 1.83x | 2.91 | 74.0% | 61.0% | – |" in body
    assert "| mt_bench | plain | 22.1 | 1.00x | – | – | – | – |" in body
    assert "- threads: 2" in body


def test_card_lists_the_tuned_budget_of_each_device_kind(target):
    drafter = PosSDrafter.from_target(target).with_generation_config()
    assert "Tuned budgets per device kind" not in str(hub.render_card(drafter))
    drafter.generation_config.device_budgets = {"cpu:avx2/float32": {"tree_depth": 5, "max_batch_size": 2},
                                                "cuda:X/bfloat16": {"tree_top_k": 8}}
    drafter.tuning_record = {"device_kinds": {"cpu:avx2/float32": {"predicted_speedup": 1.14, "command": "poss tune"}}}
    body = str(hub.render_card(drafter))
    assert "| `cpu:avx2/float32` | 5 / 10 / 60 | 2 | 1.14x | `poss tune` |" in body
    assert "| `cuda:X/bfloat16` | 6 / 8 / 60 | no limit | - | - |" in body


def test_card_without_benchmark_or_hub_target(target, tmp_path):
    local_target = tmp_path / "target"
    local_target.mkdir()
    drafter = PosSDrafter.from_target(target, target_name_or_path=str(local_target))
    text = str(hub.render_card(drafter))
    meta = _front_matter(text)
    assert "model-index" not in meta and "base_model" not in meta  # a local path is not a Hub base model
    assert "No benchmark results" in text and "No training record" in text
    assert f"target_id = {json.dumps(str(local_target))}" in text
    assert "| Target hidden states read (`feature_layers`) | the final state only |" in text
    fused = PosSDrafter.from_target(target, feature_layers=[0, -1])
    assert "| Target hidden states read (`feature_layers`) | 0, -1 (fused; -1 is the final state) |" in \
        str(hub.render_card(fused))


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda b: b.update(results=[]), "non-empty"),
        (lambda b: b["results"][0].update(speedup="fast"), "speedup must be a number"),
        (lambda b: b["results"][0].pop("dataset"), "dataset must be a non-empty string"),
        (lambda b: b["results"][0].update(position_acceptance=0.7), "position_acceptance must be a list"),
        (lambda b: b.update(environment=[1]), "environment"),
        (lambda b: [r.update(method="plain") for r in b["results"]], "no rows for this drafter"),
    ],
)
def test_bad_benchmarks_are_refused(target, mutate, message):
    benchmark = _benchmark()
    mutate(benchmark)
    with pytest.raises(ValueError, match=message):
        hub.render_card(PosSDrafter.from_target(target), benchmark)


def _tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}w3 w4 {% endif %}"
    )
    return tokenizer


def test_card_usage_snippet_runs_as_written(target, tmp_path, monkeypatch, capsys):
    target_dir, drafter_dir = tmp_path / "tiny-target", tmp_path / "tiny-drafter"
    target.save_pretrained(target_dir)
    _tiny_tokenizer().save_pretrained(target_dir)
    drafter = PosSDrafter.from_target(target, num_specialists=2, positions_per_specialist=1,
                                      target_name_or_path="tiny-target", tree_depth=3, tree_top_k=2,
                                      tree_total_tokens=6)
    drafter.save_pretrained(drafter_dir)
    hub.write_card(drafter, drafter_dir)
    monkeypatch.chdir(tmp_path)  # the card names both models the way a user would, relative to here
    card = (drafter_dir / "README.md").read_text()
    snippet = re.search(r"```python\n(.*?)```", card, re.S).group(1)
    assert 'PosSDrafter.from_pretrained("' + str(drafter_dir) + '")' in snippet
    exec(compile(snippet, "card-snippet", "exec"), {})
    printed = capsys.readouterr().out
    tau = float(re.search(r"mean acceptance length: (\S+)", printed).group(1))
    assert tau >= 1.0


def test_write_card_writes_once_and_never_overwrites(target, tmp_path):
    drafter = PosSDrafter.from_target(target, num_specialists=2, positions_per_specialist=2)
    drafter.save_pretrained(tmp_path)
    assert not (tmp_path / "README.md").exists()  # saving (training checkpoints too) renders no card
    assert hub.write_card(tmp_path, tmp_path) == tmp_path / "README.md"  # from the folder alone
    card = (tmp_path / "README.md").read_text()
    assert _front_matter(card)["library_name"] == "transformers-poss"
    (tmp_path / "README.md").write_text("my own notes\n")
    drafter.save_pretrained(tmp_path)
    assert hub.write_card(drafter, tmp_path) is None
    assert (tmp_path / "README.md").read_text() == "my own notes\n"
    loaded = PosSDrafter.from_pretrained(tmp_path)
    for key, value in drafter.state_dict().items():
        assert torch.equal(value.cpu(), loaded.state_dict()[key].cpu()), key


def test_card_cli_writes_refuses_and_prints(target, tmp_path, capsys):
    PosSDrafter.from_target(target, target_name_or_path="org/t").save_pretrained(tmp_path)
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps(_benchmark()))
    assert cli.main(["card", str(tmp_path), "--benchmark", str(bench), "--model-id", "me/x"]) == 0
    meta = _front_matter((tmp_path / "README.md").read_text())
    assert len(meta["model-index"][0]["results"]) == 2
    assert cli.main(["card", str(tmp_path)]) == 2  # exists: refused without --force
    assert "--force" in capsys.readouterr().err
    assert cli.main(["card", str(tmp_path), "--output", "-"]) == 0
    assert "model-index" not in _front_matter(capsys.readouterr().out)


# ---- push (offline: a recording stand-in for HfApi; what would be uploaded is checked) -----------------------------
class RecordingApi:
    def __init__(self, remote_readme: str | None = None, tmp_path=None):
        self.remote_readme, self.tmp_path, self.commits, self.created = remote_readme, tmp_path, [], []

    def create_repo(self, repo_id, private=None, token=None, exist_ok=False):
        self.created.append(repo_id)
        return type("RepoUrl", (), {"repo_id": repo_id if "/" in repo_id else f"me/{repo_id}"})()

    def file_exists(self, repo_id, filename, revision=None, token=None):
        return filename == "README.md" and self.remote_readme is not None

    def hf_hub_download(self, repo_id, filename, revision=None, token=None):
        path = self.tmp_path / "remote_README.md"
        path.write_text(self.remote_readme)
        return str(path)

    def create_branch(self, **kwargs):
        pass

    def create_commit(self, repo_id, operations, **kwargs):
        files = {}
        for op in operations:
            source = op.path_or_fileobj
            files[op.path_in_repo] = source if isinstance(source, bytes) else open(source, "rb").read()
        self.commits.append((repo_id, files, kwargs))
        return files


def test_push_uploads_weights_config_and_card(target, tmp_path):
    drafter = PosSDrafter.from_target(target, num_specialists=2, positions_per_specialist=2,
                                      target_name_or_path="org/t")
    api = RecordingApi(tmp_path=tmp_path)
    files = hub.push_drafter_to_hub(drafter, "tiny-poss", api=api, tags=["my-tag"])
    assert {"README.md", "model.safetensors", "config.json"} <= set(files)
    assert {"custom_generate/generate.py", "custom_generate/requirements.txt"} <= set(files)
    card = files["README.md"].decode()
    assert 'PosSDrafter.from_pretrained("me/tiny-poss")' in card  # the namespaced repo id the Hub returned
    assert 'custom_generate="me/tiny-poss", trust_remote_code=True' in card
    assert "my-tag" in _front_matter(card)["tags"]
    assert json.loads(files["config.json"])["model_type"] == "poss"
    weights_file = tmp_path / "w.safetensors"
    weights_file.write_bytes(files["model.safetensors"])
    assert torch.equal(load_file(str(weights_file))["fc.weight"], drafter.fc.weight.detach().cpu())


def test_drafter_push_to_hub_uploads_our_card(target, tmp_path):
    drafter = PosSDrafter.from_target(target, target_name_or_path="org/t")
    api = RecordingApi(tmp_path=tmp_path)
    files = drafter.push_to_hub("org/pushed-method", api=api)
    assert api.commits and {"README.md", "model.safetensors", "config.json"} <= set(files)
    card = files["README.md"].decode()
    assert "speculative-decoding" in _front_matter(card)["tags"]
    assert 'PosSDrafter.from_pretrained("org/pushed-method")' in card


def test_push_keeps_the_repo_readme(target, tmp_path):
    drafter = PosSDrafter.from_target(target)
    remote = "---\ntags:\n- theirs\n---\n# Their card\n"
    files = hub.push_drafter_to_hub(drafter, "me/x", api=RecordingApi(remote, tmp_path))
    assert "README.md" not in files and "model.safetensors" in files
    files = hub.push_drafter_to_hub(drafter, "me/x", api=RecordingApi(remote, tmp_path), tags=["extra"])
    card = files["README.md"].decode()
    assert "# Their card" in card and _front_matter(card)["tags"] == ["theirs", "extra"]


def test_save_pretrained_push_to_hub_uploads_card_and_keeps_local_files(target, tmp_path, monkeypatch):
    api = RecordingApi(tmp_path=tmp_path)
    monkeypatch.setattr("huggingface_hub.HfApi", lambda: api)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("not part of the drafter")
    PosSDrafter.from_target(target).save_pretrained(tmp_path / "out", push_to_hub=True, repo_id="org/pushed")
    repo_id, files, _ = api.commits[0]
    assert repo_id == "org/pushed"
    assert {"README.md", "model.safetensors", "config.json"} <= set(files) and "notes.txt" not in files
    assert 'PosSDrafter.from_pretrained("org/pushed")' in files["README.md"].decode()
    assert (tmp_path / "out" / "README.md").read_bytes() == files["README.md"]


# ---- research checkpoints -----------------------------------------------------------------------------------------
def write_research_checkpoint(folder, target, layers=1, bias=True, fmt="safetensors", seed=0, dtype=torch.float32,
                              input_norm_layers=(), config_layers=1):
    """An EAGLE/HASS/PosS-layout checkpoint for `target` (tensors from the key list; embedding = the target's)."""
    cfg = target.config
    hidden, inter = cfg.hidden_size, cfg.intermediate_size
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = hidden // heads
    generator = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=0.15):
        return (torch.randn(*shape, generator=generator) * scale).to(dtype)

    embedding = target.get_input_embeddings().weight.detach().clone().to(dtype)
    state = {"fc.weight": rand(hidden, 2 * hidden), "embed_tokens.weight": embedding}
    if bias:
        state["fc.bias"] = rand(hidden)
    for i in range(layers):
        p = f"layers.{i}."
        state.update({
            p + "self_attn.q_proj.weight": rand(heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": rand(kv * head_dim, hidden),
            p + "self_attn.v_proj.weight": rand(kv * head_dim, hidden),
            p + "self_attn.o_proj.weight": rand(hidden, heads * head_dim),
            p + "mlp.gate_proj.weight": rand(inter, hidden),
            p + "mlp.up_proj.weight": rand(inter, hidden),
            p + "mlp.down_proj.weight": rand(hidden, inter),
            p + "post_attention_layernorm.weight": (1 + rand(hidden, scale=0.1)).to(dtype),
        })
        if i in input_norm_layers:
            state[p + "input_layernorm.weight"] = torch.ones(hidden, dtype=dtype)
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu", "hidden_size": hidden,
        "intermediate_size": inter, "num_attention_heads": heads, "num_key_value_heads": kv,
        "num_hidden_layers": config_layers, "max_position_embeddings": 512, "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_parameters["rope_theta"], "rope_scaling": None, "vocab_size": cfg.vocab_size,
        "pretraining_tp": 1, "torch_dtype": str(dtype).replace("torch.", ""), "bias": bias,
    }
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    if fmt == "safetensors":
        save_file(state, str(folder / "model.safetensors"))
    else:
        torch.save(state, folder / "pytorch_model.bin")
    return state, config


def research_forward(state, config, layer, input_ids, features):
    """The research layout's forward, by hand from the raw tensors: embedding lookup, concat (embedding first), fc,
    then Llama layer `layer` without an input norm (RoPE, GQA causal attention, post-attention RMSNorm, SwiGLU)."""
    device = features.device
    f32 = {k: v.to(device, torch.float32) for k, v in state.items()}
    heads, kv, hidden = config["num_attention_heads"], config["num_key_value_heads"], config["hidden_size"]
    hd = hidden // heads
    x = torch.cat((f32["embed_tokens.weight"][input_ids], features), dim=-1) @ f32["fc.weight"].T
    if "fc.bias" in f32:
        x = x + f32["fc.bias"]
    p = f"layers.{layer}."
    batch, seq, _ = x.shape
    q = (x @ f32[p + "self_attn.q_proj.weight"].T).view(batch, seq, heads, hd).transpose(1, 2)
    k = (x @ f32[p + "self_attn.k_proj.weight"].T).view(batch, seq, kv, hd).transpose(1, 2)
    v = (x @ f32[p + "self_attn.v_proj.weight"].T).view(batch, seq, kv, hd).transpose(1, 2)
    inv_freq = 1.0 / (config["rope_theta"] ** (torch.arange(0, hd, 2, device=device).float() / hd))
    angles = torch.outer(torch.arange(seq, device=device).float(), inv_freq)
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()

    def rotate_half(t):
        return torch.cat((-t[..., hd // 2:], t[..., : hd // 2]), dim=-1)

    q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
    k, v = k.repeat_interleave(heads // kv, dim=1), v.repeat_interleave(heads // kv, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(hd)
    scores = scores.masked_fill(torch.ones(seq, seq, dtype=torch.bool, device=device).triu(1), float("-inf"))
    attended = (scores.softmax(-1) @ v).transpose(1, 2).reshape(batch, seq, hidden)
    h = x + attended @ f32[p + "self_attn.o_proj.weight"].T
    normed = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + config["rms_norm_eps"])
    normed = normed * f32[p + "post_attention_layernorm.weight"]
    gate, up = normed @ f32[p + "mlp.gate_proj.weight"].T, normed @ f32[p + "mlp.up_proj.weight"].T
    mlp = torch.nn.functional.silu(gate) * up
    return h + mlp @ f32[p + "mlp.down_proj.weight"].T


def _target_inputs(target, seq=9):
    ids = prompts(VOCAB, count=1, seed=3)[0][:, :seq]
    with torch.no_grad():
        features = target(ids, output_hidden_states=-1).hidden_states[-1]
    return ids, features


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("layers, settings", [(1, {}), (3, {"num_specialists": 3, "positions_per_specialist": 2})])
def test_research_checkpoint_converts_and_drafts_like_the_original(target, tmp_path, fmt, bias, layers, settings):
    state, config = write_research_checkpoint(tmp_path / "research", target, layers=layers, bias=bias, fmt=fmt)
    drafter = PosSDrafter.from_pretrained(tmp_path / "research", **settings).bind(target)
    assert drafter.config.num_specialists == layers and drafter.config.fc_bias == bias
    assert drafter.config.positions_per_specialist == settings.get("positions_per_specialist", 1)
    assert drafter.training_record["converted_from"] == str(tmp_path / "research")
    ids, features = _target_inputs(target)
    for layer in range(layers):
        expected = research_forward(state, config, layer, ids[:, 1:], features[:, :-1])
        with torch.no_grad():
            out = drafter(ids[:, 1:], features[:, :-1], specialist=layer, return_logits=True)
        torch.testing.assert_close(out.features, expected, rtol=1e-4, atol=1e-4)
        with torch.no_grad():  # the same draft tokens as the research layout
            research_tokens = target.lm_head(expected).argmax(-1)
        assert torch.equal(out.logits.argmax(-1), research_tokens)

    # native round trip: save (safetensors, config, generation config, record), load, identical weights and outputs
    drafter.save_pretrained(tmp_path / "native")
    saved = sorted(os.listdir(tmp_path / "native"))
    assert saved == ["config.json", "custom_generate", "generation_config.json", "model.safetensors",
                     "training_record.json"]
    assert "Converted from a research checkpoint" in str(hub.render_card(tmp_path / "native"))
    native_config = json.loads((tmp_path / "native" / "config.json").read_text())
    assert native_config["model_type"] == "poss" and native_config["num_specialists"] == layers
    reloaded = PosSDrafter.from_pretrained(tmp_path / "native").bind(target)
    assert set(reloaded.state_dict()) == set(drafter.state_dict())
    for key, value in drafter.state_dict().items():
        assert torch.equal(value, reloaded.state_dict()[key]), key


def test_converted_drafter_generates_losslessly(target, tmp_path):
    write_research_checkpoint(tmp_path / "r", target, layers=2, config_layers=1)
    drafter = PosSDrafter.from_pretrained(tmp_path / "r", num_specialists=2, positions_per_specialist=1,
                                         tree_depth=3, tree_top_k=2, tree_total_tokens=6)
    prompt = prompts(VOCAB, count=1)[0]
    plain = target.generate(prompt, max_new_tokens=8, do_sample=False)
    speculative = target.generate(prompt, max_new_tokens=8, do_sample=False, assistant_model=drafter,
                                  return_dict_in_generate=True)
    assert torch.equal(plain, speculative.sequences)
    assert speculative.speculative_stats.num_rounds > 0


def test_convert_cli_and_dtype(target, tmp_path, capsys):
    write_research_checkpoint(tmp_path / "src", target, layers=2, dtype=torch.float16, fmt="bin")
    target.save_pretrained(tmp_path / "target")
    argv = ["convert", str(tmp_path / "src"), str(tmp_path / "dst"), "--num-specialists", "2",
            "--positions-per-specialist", "3", "--target", str(tmp_path / "target"), "--target-name-or-path", "org/t"]
    assert cli.main(argv) == 0
    assert sorted(os.listdir(tmp_path / "dst")) == ["README.md", "config.json", "custom_generate",
                                                    "generation_config.json", "model.safetensors",
                                                    "training_record.json"]
    config = PosSConfig.from_pretrained(tmp_path / "dst")
    assert (config.num_specialists, config.positions_per_specialist, config.target_name_or_path) == (2, 3, "org/t")
    weights = load_file(str(tmp_path / "dst" / "model.safetensors"))
    assert weights["specialists.1.mlp.up_proj.weight"].dtype == torch.float16  # "auto": the checkpoint's dtype
    assert "embed_tokens.weight" not in weights and not any(k.startswith("layers.") for k in weights)
    meta = _front_matter((tmp_path / "dst" / "README.md").read_text())
    assert meta["base_model"] == "org/t"
    assert cli.main(argv) == 2  # destination not empty
    assert "not empty" in capsys.readouterr().err
    assert cli.main(argv + ["--overwrite", "--dtype", "float32"]) == 0
    assert load_file(str(tmp_path / "dst" / "model.safetensors"))["fc.weight"].dtype == torch.float32


def test_stored_embedding_must_match_the_target(target, tmp_path):
    write_research_checkpoint(tmp_path / "src", target)
    other = tiny_target("llama", vocab_size=VOCAB, seed=7)
    with pytest.raises(ValueError, match="differs from the target's"):
        research_checkpoint.convert_research_checkpoint(tmp_path / "src", tmp_path / "dst", target=other)
    assert not (tmp_path / "dst").exists()
    research_checkpoint.convert_research_checkpoint(tmp_path / "src", tmp_path / "dst", target=target)
    assert (tmp_path / "dst" / "model.safetensors").is_file()


def test_poss_presets(target, tmp_path):
    assert research_checkpoint.preset_for("HINT-lab/PosS1-Llama2-13B-Chat") == (6, 1, "meta-llama/Llama-2-13b-chat-hf")
    assert research_checkpoint.preset_for("hint-lab/poss3-llama3-8b-instruct")[:2] == (4, 3)
    assert research_checkpoint.preset_for("someone/else") is None
    snapshot = tmp_path / "hub" / "models--HINT-lab--PosS2-Llama3-8B-Instruct" / "snapshots" / "abc123"
    write_research_checkpoint(snapshot, target, layers=4)  # its config.json says num_hidden_layers 1, like PosS's
    drafter = PosSDrafter.from_pretrained(snapshot)
    config = drafter.config
    assert (config.num_specialists, config.positions_per_specialist) == (4, 2)
    assert config.target_name_or_path == "meta-llama/Meta-Llama-3-8B-Instruct"


def _edit_safetensors(folder, edit):
    state = load_file(str(folder / "model.safetensors"))
    edit(state)
    save_file(state, str(folder / "model.safetensors"))


@pytest.mark.parametrize(
    "edit, settings, message",
    [
        (lambda s: s.pop("layers.0.mlp.up_proj.weight"), {}, r"missing tensors: layers\.0\.mlp\.up_proj\.weight"),
        (lambda s: s.update({"layers.0.mlp.up_proj.weight": torch.zeros(7, 64)}), {},
         r"layers\.0\.mlp\.up_proj\.weight has \(7, 64\), expected \(128, 64\)"),
        (lambda s: s.update({"lm_head.weight": torch.zeros(VOCAB, 64)}), {}, r"unexpected tensors: lm_head\.weight"),
        (lambda s: s.pop("fc.bias"), {}, r"missing tensors: fc\.bias.*bias=True"),
        (lambda s: s.update({"layers.0.input_layernorm.weight": torch.ones(64)}), {}, "input norms before attention"),
        (None, {"num_specialists": 2, "positions_per_specialist": 1}, r"unexpected tensors: layers\.2\..*hold 3 layer"),
        (None, {}, r"unexpected tensors: layers\.1\..*num_specialists"),
        (None, {"num_specialists": 3}, "Pass positions_per_specialist"),
    ],
)
def test_research_mismatches_are_clear_errors(target, tmp_path, edit, settings, message):
    write_research_checkpoint(tmp_path, target, layers=1 if edit else 3)
    if edit:
        _edit_safetensors(tmp_path, edit)
    with pytest.raises(ValueError, match=message):
        PosSDrafter.from_pretrained(tmp_path, **settings)


def test_hass_input_norms_and_stacked_eagle_are_refused(target, tmp_path):
    write_research_checkpoint(tmp_path / "hass", target, layers=2, input_norm_layers=(1,))
    with pytest.raises(ValueError, match=r"layers\.1\.input_layernorm\.weight.*cannot be converted"):
        PosSDrafter.from_pretrained(tmp_path / "hass", num_specialists=2, positions_per_specialist=1)
    write_research_checkpoint(tmp_path / "stacked", target, layers=2, config_layers=2)
    with pytest.raises(ValueError, match="stacked EAGLE drafter"):
        PosSDrafter.from_pretrained(tmp_path / "stacked")


def test_pickle_with_code_is_refused(target, tmp_path):
    marker = tmp_path / "owned"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    state, _ = write_research_checkpoint(tmp_path / "evil", target, fmt="bin")
    torch.save({**state, "fc.weight": Payload()}, tmp_path / "evil" / "pytorch_model.bin")
    with pytest.raises(ValueError, match="Refusing to load .*pytorch_model.bin"):
        PosSDrafter.from_pretrained(tmp_path / "evil")
    assert not marker.exists()


def test_loader_option_errors(target, tmp_path):
    write_research_checkpoint(tmp_path / "r", target)
    with pytest.raises(ValueError, match="not supported when loading a research checkpoint"):
        PosSDrafter.from_pretrained(tmp_path / "r", low_memory=True)
    PosSDrafter.from_target(target).save_pretrained(tmp_path / "native")
    with pytest.raises(ValueError, match="only accepted for research-format"):
        PosSDrafter.from_pretrained(tmp_path / "native", num_specialists=2)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match="holds none of"):
        PosSDrafter.from_pretrained(tmp_path / "empty")


def test_hub_repo_id_path_reads_a_cached_snapshot_and_applies_the_preset(target, tmp_path):
    """The Hub code path (repo id -> config lookup -> snapshot_download) on a pre-filled local cache, offline."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "cache" / "models--HINT-lab--PosS3-Llama2-13B-Chat"
    write_research_checkpoint(repo / "snapshots" / commit, target, layers=2, fmt="bin")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    drafter = PosSDrafter.from_pretrained("HINT-lab/PosS3-Llama2-13B-Chat", cache_dir=tmp_path / "cache",
                                         local_files_only=True)
    assert (drafter.config.num_specialists, drafter.config.positions_per_specialist) == (2, 3)
    assert drafter.config.target_name_or_path == "meta-llama/Llama-2-13b-chat-hf"
    assert drafter.training_record["converted_from"] == "HINT-lab/PosS3-Llama2-13B-Chat"
