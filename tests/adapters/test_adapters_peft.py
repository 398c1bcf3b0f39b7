"""PEFT LoRA folders on our models, held to peft's own PeftModel on the same transformers model:
loading (every family shape: fused q/k/v, GPT-2's Conv1D, Phi-3's fused projections), the refusals
of a bad adapter, merging, and a folder written back that peft reads."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import flashformer
from flashformer.adapters import (
    AdapterError,
    adapter_per_row,
    load_peft,
    lora_layers,
    merge_adapters,
    save_peft,
    set_active,
)
from flashformer.adapters.peft import part_name, targets
from flashformer.model.models import cross_entropy
from tests.helpers import hf_config, perturbed, relative_error

peft = pytest.importorskip("peft")

# which transformers modules each family's adapter targets: fused parts, unfused ones, and the lot
TARGETS = {
    "llama": ["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"],
    "gpt2": ["c_attn", "c_proj", "c_fc"],
    "phi3": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],
    "qwen2": ["q_proj", "k_proj", "v_proj", "up_proj"],
}


def hf_model(family: str):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return perturbed(AutoModelForCausalLM.from_config(hf_config(family)))


def peft_folder(base, folder, targets, seed=1, **options):
    """A random PEFT adapter of `base` (B nonzero, so it changes the logits) saved in `folder`."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0, **options)
    model = get_peft_model(base, config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.3)
    model.save_pretrained(folder)
    return folder


def peft_logits(base_folder, adapter_folder, ids):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_folder).eval()
    with torch.no_grad():
        return PeftModel.from_pretrained(base, adapter_folder).eval()(ids).logits


@pytest.fixture(scope="module", params=sorted(TARGETS))
def pair(request, tmp_path_factory):
    """(family, base folder, adapter folder) for each family."""
    family = request.param
    folder = tmp_path_factory.mktemp(family)
    base = hf_model(family)
    base.save_pretrained(folder / "base")
    adapter = peft_folder(
        hf_model(family),
        folder / "adapter",
        TARGETS[family],
        use_rslora=family == "qwen2",
        fan_in_fan_out=family == "gpt2",
    )
    return family, folder / "base", adapter


IDS = torch.randint(3, 97, (2, 9), generator=torch.Generator().manual_seed(5))


def test_logits_with_a_peft_adapter_equal_peft(pair):
    family, base, adapter = pair
    expected = peft_logits(base, adapter, IDS)
    model = flashformer.from_pretrained(base)
    with torch.no_grad():
        plain = model(IDS).logits
    load_peft(model, adapter)
    with torch.no_grad():
        got = model(IDS).logits
    assert relative_error(plain, expected) > 1e-2, "the adapter must change the logits"
    assert relative_error(got, expected) < 1e-4, family


def test_load_takes_adapters_and_active_ones_can_change(pair):
    family, base, adapter = pair
    model = flashformer.from_pretrained(base, adapters={"mine": adapter})
    with torch.no_grad():
        with_adapter = model(IDS).logits
        set_active(model, [])
        without = model(IDS).logits
    assert relative_error(with_adapter, peft_logits(base, adapter, IDS)) < 1e-4
    with torch.no_grad():
        expected = flashformer.from_pretrained(base)(IDS).logits
    assert torch.equal(without, expected)
    with pytest.raises(ValueError, match="'other'"):
        set_active(model, ["other"])


def test_merged_adapter_equals_peft_and_saves_as_transformers(pair, tmp_path):
    from transformers import AutoModelForCausalLM

    family, base, adapter = pair
    model = flashformer.from_pretrained(base, adapters=adapter)
    merge_adapters(model)
    assert not lora_layers(model)
    model.save_pretrained(tmp_path)
    expected = peft_logits(base, adapter, IDS)
    with torch.no_grad():
        merged = AutoModelForCausalLM.from_pretrained(tmp_path).eval()(IDS).logits
    assert relative_error(merged, expected) < 1e-4


def test_saved_adapter_loads_into_peft_with_the_same_logits(pair, tmp_path):
    family, base, adapter = pair
    model = flashformer.from_pretrained(base, adapters={"mine": adapter})
    with torch.no_grad():
        ours = model(IDS).logits
    save_peft(model, "mine", tmp_path / "out")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    assert relative_error(ours, peft_logits(base, tmp_path / "out", IDS)) < 1e-4


# ---- refusals ----


def _copy(adapter, folder, tensors=None, **config_changes):
    folder.mkdir()
    config = json.loads((adapter / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps(config | config_changes))
    save_file(
        tensors if tensors is not None else load_file(adapter / "adapter_model.safetensors"),
        folder / "adapter_model.safetensors",
    )
    return folder


@pytest.fixture(scope="module")
def llama_pair(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama-refusals")
    hf_model("llama").save_pretrained(folder / "base")
    return folder / "base", peft_folder(hf_model("llama"), folder / "adapter", ["q_proj", "v_proj"])


def test_a_rank_mismatch_is_refused_naming_the_file_and_module(llama_pair, tmp_path):
    base, adapter = llama_pair
    bad = _copy(adapter, tmp_path / "bad", r=8)
    model = flashformer.from_pretrained(base)
    with pytest.raises(
        AdapterError,
        match=r"adapter_model\.safetensors.*'model\.layers\.0\.self_attn\.q_proj'.*"
        r"shape \(4, 32\); expected \(8, 32\)",
    ):
        load_peft(model, bad)
    assert not lora_layers(model), "nothing of the model changes"


def test_a_shape_mismatch_and_a_module_the_base_lacks_are_refused(llama_pair, tmp_path):
    base, adapter = llama_pair
    tensors = load_file(adapter / "adapter_model.safetensors")
    key = "base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"
    wrong_shape = dict(tensors, **{key: torch.zeros(12, 4)})
    with pytest.raises(AdapterError, match=r"v_proj.*lora_B.*\(12, 4\); expected \(16, 4\)"):
        load_peft(flashformer.from_pretrained(base), _copy(adapter, tmp_path / "shape", wrong_shape))
    extra = dict(tensors, **{key.replace("layers.1", "layers.7"): torch.zeros(16, 4)})
    with pytest.raises(AdapterError, match=r"'model\.layers\.7\.self_attn\.v_proj' is not a projection"):
        load_peft(flashformer.from_pretrained(base), _copy(adapter, tmp_path / "extra", extra))


def test_a_corrupt_file_and_unsupported_options_are_refused(llama_pair, tmp_path):
    base, adapter = llama_pair
    model = flashformer.from_pretrained(base)
    corrupt = _copy(adapter, tmp_path / "corrupt")
    (corrupt / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(AdapterError, match=r"corrupt/adapter_model\.safetensors: cannot be read"):
        load_peft(model, corrupt)
    with pytest.raises(AdapterError, match=r"use_dora=True is not supported"):
        load_peft(model, _copy(adapter, tmp_path / "dora", use_dora=True))
    with pytest.raises(AdapterError, match=r"bias='all' is not supported"):
        load_peft(model, _copy(adapter, tmp_path / "bias", bias="all"))
    with pytest.raises(AdapterError, match=r"no adapter_config\.json"):
        load_peft(model, tmp_path)


def test_one_batch_mixes_adapters_and_the_base_row_by_row(llama_pair, tmp_path):
    base, adapter = llama_pair
    other = peft_folder(hf_model("llama"), tmp_path / "other", ["k_proj", "up_proj"], seed=3)
    model = flashformer.from_pretrained(base, adapters={"a": adapter, "b": other})
    ids = IDS[:1].expand(3, -1)
    alone = {}
    with torch.no_grad():
        for names in (["a"], ["b"], []):
            set_active(model, names)
            alone[tuple(names)] = model(ids[:1]).logits
        with adapter_per_row(model, ("a", "b"), torch.tensor([1, -1, 0])):
            mixed = model(ids).logits
    assert relative_error(alone[("a",)], peft_logits(base, adapter, IDS[:1])) < 1e-4
    for row, names in enumerate([("b",), (), ("a",)]):
        assert relative_error(mixed[row : row + 1], alone[names]) < 1e-5, names


def test_a_failed_write_leaves_the_earlier_folder(pair, tmp_path, monkeypatch):
    family, base, adapter = pair
    model = flashformer.from_pretrained(base, adapters={"mine": adapter})
    out = save_peft(model, "mine", tmp_path / "out")
    before = (out / "adapter_model.safetensors").read_bytes()

    def fail(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr("flashformer.adapters.peft.save_file", fail)
    with pytest.raises(OSError, match="disk full"):
        save_peft(model, "mine", out)
    assert (out / "adapter_model.safetensors").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temporary folder left


def test_per_row_adapters_are_checked(llama_pair):
    base, adapter = llama_pair
    model = flashformer.from_pretrained(base, adapters={"a": adapter})
    with pytest.raises(ValueError, match=r"adapters \['z'\] are not loaded; loaded: \['a'\]"):
        with adapter_per_row(model, ("z",), torch.tensor([0])):
            pass
    with pytest.raises(ValueError, match=r"row_adapter: .* got \[0, 2\]"):
        with adapter_per_row(model, ("a",), torch.tensor([0, 2])):
            pass


def test_the_adapters_gradients_equal_peft(pair):
    """What training follows: the loss's gradient with respect to every A and B, against peft's
    on the same transformers model (GPT-2's Conv1D and the fused q/k/v parts included)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    family, base, adapter = pair
    theirs = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter, is_trainable=True)
    theirs.eval()  # no dropout on either side: the same function, so the same gradient
    theirs(IDS, labels=IDS).loss.backward()
    expected = {
        name.removeprefix("base_model.model.").replace(".default", ""): p.grad
        for name, p in theirs.named_parameters()
        if p.grad is not None
    }
    model = flashformer.from_pretrained(base, adapters={"mine": adapter})
    cross_entropy(model(IDS).logits[:, :-1], IDS[:, 1:]).backward()
    where = {(t.module, part_name(full)): full for full, t in targets(model).items()}
    got = {}
    for module, layer in lora_layers(model).items():
        for factor in "AB":
            for part, p in getattr(layer.adapters["mine"], factor).items():
                got[f"{where[(module, part)]}.lora_{factor}.weight"] = p.grad
    assert got.keys() == expected.keys()
    for name in got:
        assert relative_error(got[name], expected[name]) < 1e-4, name


@pytest.mark.parametrize(
    "family, targets", [("bert", ["query", "value", "dense"]), ("t5", ["q", "v", "wi", "o"])]
)
def test_encoder_and_encoder_decoder_adapters_equal_peft(family, targets, tmp_path):
    """BERT (its attention, feed-forward and masked-LM head's dense layers) and T5 (both stacks)."""
    from peft import PeftModel
    from transformers import AutoModelForMaskedLM, AutoModelForSeq2SeqLM

    kind = AutoModelForMaskedLM if family == "bert" else AutoModelForSeq2SeqLM
    torch.manual_seed(0)
    perturbed(kind.from_config(hf_config(family))).save_pretrained(tmp_path / "base")
    adapter = peft_folder(perturbed(kind.from_config(hf_config(family))), tmp_path / "adapter", targets)
    inputs = dict(decoder_input_ids=IDS) if family == "t5" else {}
    model = flashformer.from_pretrained(tmp_path / "base", adapters={"mine": adapter})
    save_peft(model, "mine", tmp_path / "written")
    with torch.no_grad():
        got = model(IDS, **inputs).logits
        for folder in (adapter, tmp_path / "written"):
            theirs = PeftModel.from_pretrained(kind.from_pretrained(tmp_path / "base"), folder).eval()
            assert relative_error(got, theirs(IDS, **inputs).logits) < 1e-4, folder


def test_a_packed_row_takes_an_adapter_per_token():
    """One LoRALinear over a row of tokens from several sequences (a packed step): each token's
    output is the one its own adapter gives it alone."""
    from flashformer.adapters import AdapterSettings, LoRALinear

    torch.manual_seed(0)
    layer = LoRALinear(torch.nn.Linear(8, 12))
    for name in ("a", "b"):
        low_rank = layer.add(name, AdapterSettings(rank=2, alpha=4.0), {"q": (0, 6), "v": (8, 12)})
        with torch.no_grad():
            for factor in (low_rank.A, low_rank.B):
                for p in factor.values():
                    p.normal_()
    x = torch.randn(1, 5, 8)
    tokens = torch.tensor([[0, 1, -1, 0, 1]])
    with adapter_per_row(layer, ("a", "b"), tokens), torch.no_grad():
        mixed = layer(x)
    with torch.no_grad():
        for position, index in enumerate(tokens[0].tolist()):
            layer.active = () if index < 0 else (("a", "b")[index],)
            alone = layer(x[:, position : position + 1])
            assert torch.allclose(mixed[:, position : position + 1], alone, atol=1e-6), position
