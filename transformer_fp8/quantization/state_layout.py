"""The names of an FP8 module's state buffers (Fp8State, state.py; the table in its docstring):
the float32 histories, scales and scale_invs, and the int64 recipe record."""

FP8_FLOAT_STATE = ("fp8_fwd_amax_history", "fp8_fwd_scale", "fp8_fwd_scale_inv",
                   "fp8_bwd_amax_history", "fp8_bwd_scale", "fp8_bwd_scale_inv")
FP8_STATE_KEYS = FP8_FLOAT_STATE + ("fp8_recipe_fields",)
HISTORIES = ("fp8_fwd_amax_history", "fp8_bwd_amax_history")
