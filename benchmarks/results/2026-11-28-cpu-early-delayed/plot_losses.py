"""The loss curves of losses.json (repro.py's run) on one figure: losses.png."""
import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
losses = json.load(open(os.path.join(HERE, "losses.json")))["losses"]
fig, ax = plt.subplots(figsize=(7, 4))
for key, values in losses.items():
    ax.plot(range(1, len(values) + 1), values, label=key, marker="o", markersize=3)
ax.set_xlabel("step")
ax.set_ylabel("training loss")
ax.set_title("d512 x 4 GPT, CPU: DelayedScaling's first steps")
ax.legend()
fig.tight_layout()
fig.savefig(os.path.join(HERE, "losses.png"), dpi=110)
