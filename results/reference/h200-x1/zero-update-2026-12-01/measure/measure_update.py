"""Measure norm-relative update error of ZeRO vs DDP, with an lr factor on the DS side."""
import gc, sys, json, time
import torch
from suites import zero_ranks as zr
from suites.zero_ranks import ZeroCase, MLP


def rank_fn(case, lr_factor):
    from dsconform.suite import device, rank, seed_everything
    seed_everything(case.seed)
    dev = torch.device(device())
    model = MLP(case.d_in, case.width, case.d_out)
    ref = MLP(case.d_in, case.width, case.d_out)
    ref.load_state_dict(model.state_dict())
    init = {n: p.detach().clone().float() for n, p in model.named_parameters()}
    data = zr._data(case, rank())
    ddp = zr._train_ddp(ref, case, data, dev)
    ds = zr._train_deepspeed(model.to(dev), case.with_(lr=case.lr * lr_factor), data, dev, 1.0, 0)
    gc.collect()
    out = {}
    for n in init:
        da = ds["params"][n] - init[n]
        db = ddp["params"][n] - init[n]
        out[n] = (float((da - db).norm() / db.norm()), float((da*db).sum()/(db*db).sum()), float((ds["params"][n]-ddp["params"][n]).abs().max()), float(db.abs().max()))
    da = torch.cat([(ds["params"][n] - init[n]).flatten() for n in init])
    db = torch.cat([(ddp["params"][n] - init[n]).flatten() for n in init])
    out["__all__"] = (float((da - db).norm() / db.norm()), float((da*db).sum()/(db*db).sum()), 0.0, float(db.abs().max()))
    return out


def main():
    from dsconform.suite import run_ranks
    accel = sys.argv[1]
    factors = [float(f) for f in sys.argv[2].split(",")]
    sel = sys.argv[3] if len(sys.argv) > 3 else ""
    wss = (1, 2) if accel == "cpu" else (1,)
    cases = [c for c in zr.matrix(world_sizes=wss) if c.dtype in ("bf16", "fp16")]
    if accel == "cpu":
        cases = [c for c in cases if c.dtype == "bf16" and c.optimizer != "fused_adam"]
    if sel:
        cases = [c for c in cases if sel in c.id]
    for c in cases:
        for f in factors:
            t = time.time()
            try:
                res = run_ranks(rank_fn, c.world_size, args=(c, f), accelerator=accel, timeout_s=600)
                worst = max(v[0] for r in res for v in r.values())
                pabs = max(v[2] for r in res for v in r.values())
                gains = [v[1] for r in res for v in r.values()]
                allr = [r["__all__"] for r in res]
                print(json.dumps({"all_rel": max(a[0] for a in allr), "all_gain": [round(a[1],5) for a in allr], "case": c.id, "f": f, "upd_rel": worst, "param_abs": pabs,
                                  "gain_min": min(gains), "gain_max": max(gains), "upd_max": max(v[3] for r in res for v in r.values()),
                                  
                                  "s": round(time.time() - t, 1)}), flush=True)
            except Exception as e:
                print(json.dumps({"case": c.id, "f": f, "error": str(e)[:300]}), flush=True)


if __name__ == "__main__":
    main()
