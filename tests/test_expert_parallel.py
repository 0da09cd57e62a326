"""Expert parallel (Switch-Transformers) against the single-process reference; gloo ranks on CPU.

The reference is the unmodified HF model (router capacity, token dropping, z-loss and aux-loss all
HF's own); see tests/parallel_harness.py for what each case runs and measures.
"""

import pytest

from parallel_harness import run_cases

TOL = 1e-5


@pytest.fixture(scope="module")
def ep_on_2(tmp_path_factory):
    return run_cases(2, ["switch_ep2", "switch_ep2_empty"], str(tmp_path_factory.mktemp("ep2")), timeout_s=150)


@pytest.fixture(scope="module")
def ep_on_4(tmp_path_factory):
    return run_cases(4, ["switch_ep4", "switch_ep2_dp2"], str(tmp_path_factory.mktemp("ep4")), timeout_s=150)


def _check_parity(m: dict) -> None:
    assert "error" not in m, m["error"]
    assert m["same_keys"], "gathered state dict keys differ from the unmodified model's"
    assert m["params_moved"] > 1e-4, "training did not move the weights; parity would be vacuous"
    assert m["grad_rel"] < TOL and m["grad_rel_worst_tensor"] < TOL, m  # step 0, before Adam amplifies noise
    assert m["loss_rel"] < TOL, m
    assert m["param_rel"] < TOL, m
    assert m["param_rel_worst_tensor"] < 10 * TOL, m["worst"]
    assert m["null_grad_numel"] == 0, m


def test_ep2_matches_reference(ep_on_2):
    m = ep_on_2["switch_ep2"]
    _check_parity(m)
    assert set(m["placements"].values()) == {"expert"}
    assert len(m["placements"]) == 4 * 4 * 2  # 4 sparse layers x 4 experts x (wi, wo)


@pytest.mark.parametrize("case", ["switch_ep4", "switch_ep2_dp2"])
def test_ep4_and_ep2_x_dp2_match_reference(ep_on_4, case):
    _check_parity(ep_on_4[case])


def test_experts_without_tokens_do_not_hang_and_only_decay(ep_on_2):
    # experts 2 and 3 (all of ep rank 1's experts) never win the router: rank 1 receives no tokens
    m = ep_on_2["switch_ep2_empty"]
    _check_parity(m)
    assert m["num_idle_tensors"] == 4 * 2 * 2
    assert m["idle_decay_only_rel"] < 1e-6, m  # p_5 = p_0 * (1 - lr * wd)^5, as in the reference
    assert m["busy_moved_rel"] > 1e-3, m  # the experts that got tokens did learn


def test_ep_save_loads_into_unmodified_class(ep_on_2):
    m = ep_on_2["switch_ep2"]
    assert "error" not in m, m["error"]
    assert m["loaded_class"] == "SwitchTransformersForConditionalGeneration"
    assert m["loaded_keys_match"] and m["loaded_bitwise"], m
    assert m["logits_rel"] < TOL, m
