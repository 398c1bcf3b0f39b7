"""Adapters: LoRA beside a model's projections, loaded from PEFT folders, trained, written back.

    name = load_peft(model, "adapters/math")       # float or quantized base: the product beside it
    save_peft(model, name, "out/math")             # a PEFT folder PeftModel.from_pretrained reads
    merge_adapters(model)                          # a float model with the adapters in its weights

lora.py: the low-rank product beside a projection (LoRALinear), per model or per batch row;
peft.py: PEFT's folders in and out, through the family's naming rules (model/hf/).
"""

from flashformer.adapters.lora import (
    AdapterSettings,
    LoRALinear,
    adapter_per_row,
    lora_layers,
    merge_adapters,
    remove_adapter,
    set_active,
)
from flashformer.adapters.peft import AdapterError, add_lora, load_adapters, load_peft, save_peft

__all__ = [
    "AdapterError",
    "AdapterSettings",
    "add_lora",
    "LoRALinear",
    "adapter_per_row",
    "load_adapters",
    "load_peft",
    "lora_layers",
    "merge_adapters",
    "remove_adapter",
    "save_peft",
    "set_active",
]
