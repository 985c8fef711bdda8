import json, sys, collections
r = json.load(open(sys.argv[1]))
key = sys.argv[2] if len(sys.argv) > 2 else "delayed"
layer_filter = sys.argv[3] if len(sys.argv) > 3 else None
recs = r[key]["stats"]
for s in sorted({x["step"] for x in recs}):
    for rec in recs:
        if rec["step"] != s or (layer_filter and layer_filter not in rec["layer"]): continue
        fmax = 448 if rec["tensor"] in ("input", "weight") else 57344
        cur = fmax / rec["amax"] if rec["amax"] else float("nan")
        print(f'{s:3d} {rec["layer"]:14s} {rec["tensor"]:12s} amax {rec["amax"]:.3e} scale {rec["scale_max"]:.3e} cur {cur:.3e} ratio {rec["scale_max"]/cur:8.3g} uf {rec["underflow_frac"]:.4f} sat {rec["saturation_frac"]:.2e} sqnr {rec["sqnr_db"]:.1f}')
