"""The recipes as Transformer Engine's users write them: `from transformer_fp8.recipe import
...` (transformer_engine.common.recipe's place), the Recipe base class and its questions,
Transformer Engine's switches (fp8_dpa, fp8_mha, backward_override, use_power_2_scales,
use_f32_scales) and the environment variables behind their defaults, and the Blackwell recipes
(importable, refused when made)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import transformer_fp8 as tfp8


def test_recipe_is_a_module_of_its_own():
    from transformer_fp8.recipe import DelayedScaling, Format  # Transformer Engine's idiom
    import transformer_fp8.recipe as recipe

    assert tfp8.recipe is recipe
    assert DelayedScaling is tfp8.DelayedScaling and Format is tfp8.Format
    assert recipe.DelayedScaling(fp8_format=Format.E4M3).fp8_format is Format.E4M3


@pytest.mark.parametrize("cls,answers", [
    (tfp8.DelayedScaling, dict(delayed=True, float8_per_tensor_scaling=True)),
    (tfp8.Float8CurrentScaling, dict(float8_current_scaling=True, float8_per_tensor_scaling=True)),
    (tfp8.Float8BlockScaling, dict(float8_block_scaling=True)),
    (tfp8.Float8RowwiseScaling, dict(float8_rowwise_scaling=True)),
    (tfp8.recipe.MXFP8BlockScaling, dict(mxfp8=True)),
    (tfp8.recipe.NVFP4BlockScaling, dict(nvfp4=True)),
    (tfp8.recipe.CustomRecipe, dict(custom=True)),
])
def test_the_base_class_answers_which_recipe_it_is(cls, answers):
    questions = ("delayed", "float8_current_scaling", "float8_per_tensor_scaling",
                 "float8_block_scaling", "float8_rowwise_scaling", "mxfp8", "nvfp4", "custom")
    assert issubclass(cls, tfp8.recipe.Recipe)
    for question in questions:
        assert getattr(cls, question)() is answers.get(question, False), question
    if cls in (tfp8.DelayedScaling, tfp8.Float8CurrentScaling, tfp8.Float8BlockScaling):
        instance = cls()
        assert isinstance(instance, tfp8.recipe.Recipe)
        for question in questions:
            assert getattr(instance, question)() is answers.get(question, False), question


@pytest.mark.parametrize("name", ["MXFP8BlockScaling", "NVFP4BlockScaling", "CustomRecipe"])
def test_blackwell_and_custom_recipes_import_and_are_refused_when_made(name):
    cls = getattr(tfp8.recipe, name)
    with pytest.raises(NotImplementedError, match=f"{name} is not supported"):
        cls()


@pytest.mark.parametrize("cls", [tfp8.DelayedScaling, tfp8.Float8CurrentScaling,
                                 tfp8.Float8BlockScaling])
def test_transformer_engines_switches_at_their_defaults(cls):
    recipe = cls(fp8_dpa=False, fp8_mha=False, backward_override=None)
    assert recipe == cls()
    for switch in ("fp8_dpa", "fp8_mha"):
        with pytest.raises(ValueError, match=f"{switch}=True .* not supported"):
            cls(**{switch: True})
        with pytest.raises(ValueError, match=f"{switch} must be True or False"):
            cls(**{switch: "yes"})
    if cls is tfp8.DelayedScaling:  # (as Transformer Engine; the others take it:
        with pytest.raises(ValueError, match="backward_override='high_precision' is not "
                                             "supported with delayed scaling"):
            cls(backward_override="high_precision")  # test_backward_override.py)


@pytest.mark.parametrize("cls", [tfp8.DelayedScaling, tfp8.Float8CurrentScaling,
                                 tfp8.Float8BlockScaling])
def test_nvte_backward_override_is_not_ignored(monkeypatch, cls):
    """Transformer Engine takes backward_override's default from NVTE_BACKWARD_OVERRIDE (a
    high-precision backward): taken by the recipes that support it, refused by name by
    delayed scaling (as Transformer Engine) rather than ignored; empty is unset."""
    monkeypatch.setenv("NVTE_BACKWARD_OVERRIDE", "dequantized")
    if cls is tfp8.DelayedScaling:
        with pytest.raises(ValueError, match="NVTE_BACKWARD_OVERRIDE"):
            cls()
    else:
        assert cls().backward_override == "dequantized"
    monkeypatch.setenv("NVTE_BACKWARD_OVERRIDE", "")
    assert cls().backward_override is None


def test_the_package_imports_and_trains_with_nvte_backward_override_set():
    """NVTE_BACKWARD_OVERRIDE set for the whole process (as training configs do): the import
    made a DelayedScaling, which refuses it, so `import transformer_fp8` raised. A fresh
    interpreter with the variable set imports the package and trains under
    Float8CurrentScaling with the override; the default recipe (delayed) names the variable."""
    import os
    import subprocess
    import sys
    code = (
        "import torch, transformer_fp8 as tfp8\n"
        "layer = tfp8.Linear(32, 16)\n"
        "x = torch.randn(8, 32, requires_grad=True)\n"
        "with tfp8.fp8_autocast(fp8_recipe=tfp8.Float8CurrentScaling()):\n"
        "    layer(x).sum().backward()\n"
        "assert tfp8.Float8CurrentScaling().backward_override == 'high_precision'\n"
        "try:\n"
        "    tfp8.fp8_autocast().__enter__()\n"
        "except ValueError as e:\n"
        "    assert 'NVTE_BACKWARD_OVERRIDE' in str(e), e\n"
        "else:\n"
        "    raise AssertionError('the default delayed recipe took the override')\n"
        "print('ok')\n")
    package_root = os.path.dirname(os.path.dirname(tfp8.__file__))
    env = dict(os.environ, NVTE_BACKWARD_OVERRIDE="high_precision",
               PYTHONPATH=os.pathsep.join([package_root, os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]


def test_current_scaling_power_2_scales(monkeypatch):
    """Accepted (test_current_scaling_power_2.py), from the argument or the variable."""
    assert tfp8.Float8CurrentScaling(use_power_2_scales=False) == tfp8.Float8CurrentScaling()
    assert tfp8.Float8CurrentScaling(use_power_2_scales=True).use_power_2_scales
    with pytest.raises(ValueError, match="use_power_2_scales must be True or False"):
        tfp8.Float8CurrentScaling(use_power_2_scales=1)
    monkeypatch.setenv("NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES", "1")
    assert tfp8.Float8CurrentScaling().use_power_2_scales


def test_block_scaling_f32_scales(monkeypatch):
    """Transformer Engine's use_f32_scales (and NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1, its
    default) is power_2_scale's opposite; an explicit argument wins over the variable."""
    Block = tfp8.Float8BlockScaling
    assert Block().power_2_scale is True
    assert Block(use_f32_scales=True) == Block(power_2_scale=False)
    assert Block(use_f32_scales=False) == Block(power_2_scale=True) == Block()
    with pytest.raises(ValueError, match="use_f32_scales must be True or False"):
        Block(use_f32_scales=1)
    monkeypatch.setenv("NVTE_FP8_BLOCK_SCALING_FP32_SCALES", "1")
    assert Block().power_2_scale is False
    assert Block(power_2_scale=True).power_2_scale is True
    assert Block(use_f32_scales=False).power_2_scale is True
    # Recipes are frozen; dataclasses.replace makes a changed copy.
    recipe = Block(power_2_scale=True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        recipe.power_2_scale = False
    assert dataclasses.replace(recipe, power_2_scale=False).power_2_scale is False
    assert dataclasses.replace(recipe, use_f32_scales=True).power_2_scale is False



def test_constructor_only_arguments_read_back_their_defaults():
    """use_f32_scales and interval are constructor arguments only (dataclass InitVars): the
    attributes of those names read the class defaults, not what was passed (README: read
    power_2_scale back)."""
    recipe = tfp8.Float8BlockScaling(use_f32_scales=True)
    assert recipe.power_2_scale is False and recipe.use_f32_scales is None
    with pytest.warns(DeprecationWarning, match="interval is deprecated and unused"):
        assert tfp8.DelayedScaling(interval=5).interval == -1

def test_transformer_engine_1x_delayed_scaling_arguments():
    """1.x's quickstart wrote DelayedScaling(margin=0, interval=1, fp8_format=...): interval is
    accepted (deprecated and unused, as there); override_linear_precision at its default only."""
    with pytest.warns(DeprecationWarning, match="interval is deprecated and unused"):
        recipe = tfp8.DelayedScaling(margin=0, interval=1, fp8_format=tfp8.Format.HYBRID,
                                     amax_history_len=16)
    assert recipe == tfp8.DelayedScaling(amax_history_len=16)
    assert tfp8.DelayedScaling(override_linear_precision=(False, False, False)) == \
        tfp8.DelayedScaling()
    with pytest.raises(ValueError, match="override_linear_precision=.* not supported"):
        tfp8.DelayedScaling(override_linear_precision=(False, False, True))
    with pytest.raises(ValueError, match="interval must be an int"):
        tfp8.DelayedScaling(interval="1")


@pytest.mark.parametrize("cls", [tfp8.DelayedScaling, tfp8.Float8CurrentScaling,
                                 tfp8.Float8BlockScaling])
def test_recipes_pickled_before_the_new_fields_load(cls):
    """A recipe pickled before fp8_dpa, fp8_mha, backward_override and use_power_2_scales
    existed (torch.save(model) holds the recipes) loads equal to one made now (its repr, hash
    and a training step under it raised AttributeError)."""
    import pickle

    now = cls()
    old = object.__new__(cls)
    old.__dict__.update({k: v for k, v in now.__dict__.items()
                         if k not in ("fp8_dpa", "fp8_mha", "backward_override",
                                      "use_power_2_scales")})
    loaded = pickle.loads(pickle.dumps(old))
    assert loaded == now and hash(loaded) == hash(now) and repr(loaded) == repr(now)
    layer = tfp8.Linear(32, 16)
    with tfp8.fp8_autocast(fp8_recipe=loaded):
        layer(torch.randn(16, 32)).sum().backward()


def test_override_linear_precision_is_named_whatever_is_given():
    with pytest.raises(ValueError, match="override_linear_precision=None"):
        tfp8.DelayedScaling(override_linear_precision=None)


def test_format_values_carry_transformer_engines_maxima():
    """Format.HYBRID.value.max_fwd (Transformer Engine's _FormatHelper fields) works, and the
    value is still the format's name."""
    from transformer_fp8.recipe import Format
    assert [(f.value, f.value.max_fwd, f.value.max_bwd) for f in Format] == [
        ("E4M3", 448.0, 448.0), ("E5M2", 57344.0, 57344.0), ("HYBRID", 448.0, 57344.0)]
    assert all((f.max_fwd, f.max_bwd) == (f.value.max_fwd, f.value.max_bwd) for f in Format)
    assert Format("HYBRID") is Format.HYBRID
