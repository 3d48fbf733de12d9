"""`laco-deploy inspect`: load a model (converting and caching `default` or a GGUF once) and describe it."""

from __future__ import annotations

import time

from laco_deploy.cli.app import app
from laco_deploy.cli.common import AllowPickleOpt, ModelOpt, TrustRemoteCodeOpt, console, model_config
from laco_deploy.config import DEFAULT_MODEL


@app.command("inspect")
def inspect_model(model: ModelOpt = DEFAULT_MODEL, allow_pickle: AllowPickleOpt = False,
                  trust_remote_code: TrustRemoteCodeOpt = False) -> None:
    """Load a model and print its architecture, size and where it is cached.

    The first load of `default` or of a .gguf file dequantizes it into the cache
    ($LACO_DEPLOY_CACHE, default ~/.cache/laco-deploy) so that later runs start in seconds.
    """
    from laco_deploy import structured
    from laco_deploy.models import check_architecture, load_model

    cfg = model_config(model, "cpu", allow_pickle, trust_remote_code)
    t0 = time.perf_counter()
    loaded = load_model(cfg.model, allow_pickle=cfg.allow_pickle, trust_remote_code=cfg.trust_remote_code)
    elapsed = time.perf_counter() - t0
    c = loaded.model.config
    params = sum(p.numel() for p in loaded.model.parameters())
    console.print(f"model        {loaded.source} ({loaded.kind})")
    console.print(f"family       {check_architecture(c)}  layers={c.num_hidden_layers} hidden={c.hidden_size} "
                  f"heads={c.num_attention_heads}/{c.num_key_value_heads} ffn={c.intermediate_size} vocab={c.vocab_size}")
    if structured.loads_in_plain_transformers(c):
        console.print("loads with   transformers AutoModelForCausalLM.from_pretrained (no laco-deploy needed)")
    else:
        console.print(f"loads with   {structured.LOADER} (layers differ in width: "
                      f"{structured.WIDTHS_KEY} in config.json)")
    console.print(f"parameters   {params / 1e6:.1f} M")
    console.print(f"weights at   {loaded.path}")
    console.print(f"loaded in    {elapsed:.1f} s")
