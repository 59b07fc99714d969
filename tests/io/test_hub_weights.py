"""``load_path`` in the Hub's weights format (safetensors file, ``save_pretrained`` directory with index and
shards): a weights-only start for fine-tuning, checked against the safetensors headers, never unpickled."""
import json
import os

import pytest
import torch
from safetensors.torch import save_file

from ckptstore import CheckpointError, CorruptCheckpointError, IncompatibleCheckpointError, Store


class TinyLM(torch.nn.Module):
    """Tied input / output embeddings, as GPT-2 has: save_pretrained drops the tied ``lm_head.weight``."""

    def __init__(self, vocab=50, dim=16):
        super().__init__()
        self.wte = torch.nn.Embedding(vocab, dim)
        self.block = torch.nn.Linear(dim, dim)
        self.norm = torch.nn.LayerNorm(dim)
        self.lm_head = torch.nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, ids):
        return self.lm_head(self.norm(torch.relu(self.block(self.wte(ids)))))


def _hub_weights(model):
    sd = {k: v.detach().clone() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    return sd


def _pretrained(seed=1):
    torch.manual_seed(seed)
    return TinyLM()


def _write_sharded(d, weights, shards=2):
    d.mkdir(parents=True, exist_ok=True)
    keys = sorted(weights)
    weight_map = {}
    for i in range(shards):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: weights[k].contiguous() for k in keys[i::shards]}
        save_file(part, str(d / name))
        weight_map.update({k: name for k in part})
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return weight_map


def _fresh_state():
    torch.manual_seed(99)
    model = TinyLM()
    return {"model": model, "optimizer": torch.optim.AdamW(model.parameters(), lr=1e-3), "step": 0}


def _assert_loaded(model, weights):
    sd = model.state_dict()
    for k, v in weights.items():
        assert torch.equal(sd[k], v.to(sd[k].dtype)), k
    assert model.lm_head.weight.data_ptr() == model.wte.weight.data_ptr()     # still tied


@pytest.mark.parametrize("layout", ["file", "dir_single", "dir_sharded"])
def test_hub_weights_start_a_fresh_run_then_the_runs_own_steps_win(tmp_path, layout):
    weights = _hub_weights(_pretrained())
    if layout == "file":
        save_file(weights, str(tmp_path / "w.safetensors"))
        load_path = str(tmp_path / "w.safetensors")
    elif layout == "dir_single":
        (tmp_path / "hf").mkdir()
        save_file(weights, str(tmp_path / "hf" / "model.safetensors"))
        load_path = str(tmp_path / "hf")
    else:
        _write_sharded(tmp_path / "hf", weights)
        load_path = str(tmp_path / "hf")
    state = _fresh_state()
    with Store(tmp_path / "run", load_path=load_path) as s:
        assert s.resume(state) is None                       # the run itself starts fresh
        assert s.resumed_from["tier"] == "load_path" and s.resumed_from["components"] == ["model"]
        _assert_loaded(state["model"], weights)
        state["model"](torch.randint(0, 50, (4,))).sum().backward()
        state["optimizer"].step()
        s.save(state, 1)
        trained = {k: v.clone() for k, v in state["model"].state_dict().items()}
    state = _fresh_state()
    with Store(tmp_path / "run", load_path=load_path) as s:
        assert s.resume(state) == 1                          # its own step, not the weights
        for k, v in trained.items():
            assert torch.equal(state["model"].state_dict()[k], v)


def test_bf16_weights_go_into_fp32_parameters(tmp_path):
    weights = {k: v.to(torch.bfloat16) for k, v in _hub_weights(_pretrained()).items()}
    save_file(weights, str(tmp_path / "model.safetensors"))
    state = _fresh_state()
    with Store(tmp_path / "run", load_path=str(tmp_path)) as s:
        s.resume(state)
    assert state["model"].block.weight.dtype == torch.float32
    _assert_loaded(state["model"], weights)


def test_load_components_names_the_target_key(tmp_path):
    weights = _hub_weights(_pretrained())
    save_file(weights, str(tmp_path / "w.safetensors"))
    state = _fresh_state()
    state = {"policy": state["model"], "optimizer": state["optimizer"]}
    with Store(tmp_path / "run", load_path=str(tmp_path / "w.safetensors"), load_components=["policy"]) as s:
        s.resume(state)
    _assert_loaded(state["policy"], weights)
    with pytest.raises(CheckpointError, match="must name one key"):
        with Store(tmp_path / "run2", load_path=str(tmp_path / "w.safetensors"),
                   load_components=["policy", "optimizer"]) as s:
            s.resume(state)


def _corrupt_cases(tmp_path):
    weights = _hub_weights(_pretrained())

    def truncated(d):
        save_file(weights, str(d / "model.safetensors"))
        p = d / "model.safetensors"
        p.write_bytes(p.read_bytes()[:-7])

    def header_past_end(d):
        """A header whose first tensor's end offset points 4 KiB past the data (re-serialised header)."""
        save_file(weights, str(d / "model.safetensors"))
        p = d / "model.safetensors"
        raw = p.read_bytes()
        n = int.from_bytes(raw[:8], "little")
        header = json.loads(raw[8:8 + n])
        key = sorted(k for k in header if k != "__metadata__")[0]
        header[key]["data_offsets"][1] += 4096
        body = json.dumps(header).encode()
        p.write_bytes(len(body).to_bytes(8, "little") + body + raw[8 + n:])

    def index_names_missing_tensor(d):
        wm = _write_sharded(d, weights)
        wm["ghost.weight"] = sorted(set(wm.values()))[0]
        (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))

    def index_maps_to_wrong_shard(d):
        wm = _write_sharded(d, weights)
        k = sorted(wm)[0]
        shards = sorted(set(wm.values()))
        wm[k] = shards[1] if wm[k] == shards[0] else shards[0]
        (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))

    def index_escapes_directory(d):
        wm = _write_sharded(d, weights)
        wm = {k: "../elsewhere.safetensors" for k in wm}
        (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))

    def index_not_json(d):
        _write_sharded(d, weights)
        (d / "model.safetensors.index.json").write_text("{not json")

    def shard_missing(d):
        wm = _write_sharded(d, weights)
        os.remove(d / sorted(set(wm.values()))[1])

    def fifo_shard(d):
        wm = _write_sharded(d, weights)
        name = d / sorted(set(wm.values()))[1]
        os.remove(name)
        os.mkfifo(name)

    return {f.__name__: f for f in (truncated, header_past_end, index_names_missing_tensor,
                                    index_maps_to_wrong_shard, index_escapes_directory, index_not_json,
                                    shard_missing, fifo_shard)}


@pytest.mark.parametrize("case", ["truncated", "header_past_end", "index_names_missing_tensor",
                                  "index_maps_to_wrong_shard", "index_escapes_directory", "index_not_json",
                                  "shard_missing", "fifo_shard"])
def test_damaged_hub_weights_are_refused_naming_the_file_and_nothing_is_loaded(tmp_path, case):
    d = tmp_path / "hf"
    d.mkdir()
    _corrupt_cases(tmp_path)[case](d)
    state = _fresh_state()
    before = {k: v.clone() for k, v in state["model"].state_dict().items()}
    with Store(tmp_path / "run", load_path=str(d)) as s:
        with pytest.raises(CorruptCheckpointError, match=str(d)):
            s.resume(state)
    for k, v in state["model"].state_dict().items():
        assert torch.equal(v, before[k]), k


def test_weights_that_do_not_fit_the_model_are_refused_and_nothing_is_loaded(tmp_path):
    weights = _hub_weights(_pretrained())
    weights["block.weight"] = torch.zeros(8, 16)          # another shape
    weights["extra.bias"] = torch.zeros(3)                # unknown to the model
    del weights["norm.bias"]                              # a parameter the file lacks (and that is not tied)
    save_file(weights, str(tmp_path / "w.safetensors"))
    state = _fresh_state()
    before = {k: v.clone() for k, v in state["model"].state_dict().items()}
    with Store(tmp_path / "run", load_path=str(tmp_path / "w.safetensors")) as s:
        with pytest.raises(IncompatibleCheckpointError) as ei:
            s.resume(state)
    msg = str(ei.value)
    assert "block.weight" in msg and "extra.bias" in msg and "norm.bias" in msg
    for k, v in state["model"].state_dict().items():
        assert torch.equal(v, before[k]), k


def test_pickled_weights_are_not_taken_for_hub_weights(tmp_path):
    """A directory holding only ``pytorch_model.bin`` is not Hub-format safetensors: it is read as a
    ckptstore store (which it is not), and nothing is unpickled."""
    d = tmp_path / "hf"
    d.mkdir()
    torch.save(_hub_weights(_pretrained()), d / "pytorch_model.bin")
    with Store(tmp_path / "run", load_path=str(d)) as s:
        with pytest.raises(CheckpointError, match="no valid committed step"):
            s.resume(_fresh_state())


def test_a_real_save_pretrained_directory_loads_bit_for_bit(tmp_path):
    """transformers' own writer (sharded, tied lm_head dropped) as the source: nothing downloaded, a config-only
    tiny GPT-2."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=300, n_positions=64,
                                  bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    src = transformers.GPT2LMHeadModel(cfg)
    src.save_pretrained(tmp_path / "hf", max_shard_size="100KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists()
    torch.manual_seed(1)
    dst = transformers.GPT2LMHeadModel(cfg)
    with Store(tmp_path / "run", load_path=str(tmp_path / "hf")) as s:
        assert s.resume({"model": dst}) is None
        assert len(s.resumed_from["files"]) > 1
    for k, v in src.state_dict().items():
        assert torch.equal(dst.state_dict()[k], v), k
