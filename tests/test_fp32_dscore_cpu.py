"""The backward that stores dscore in fp32 (plan.KernelSpec.fp32_dscore, for the
transformers adapter): where the spec takes it, and compile-only for sm_90a / sm_100a."""

import pytest
import torch

from csa_compressor.kernels import plan


def test_the_spec_takes_fp32_dscore_only_where_it_means_something():
    s = plan.spec("bwd", torch.bfloat16, 4, 2, 128, fp32_dscore=True)
    assert s.fp32_dscore and s != plan.spec("bwd", torch.bfloat16, 4, 2, 128)
    assert "fp32 dscore" in str(s)
    # fp32 inputs store fp32 anyway; forwards and the dape sums have no dscore
    assert not plan.spec("bwd", torch.float32, 4, 2, 128, fp32_dscore=True).fp32_dscore
    assert not plan.spec("fwd", torch.bfloat16, 4, 2, 128, fp32_dscore=True).fp32_dscore
    assert all(not f.fp32_dscore for f in plan.family(s)[1:3])  # the dape sums
    assert plan.family(s)[-1].fp32_dscore  # the large-pack variant keeps it
    for kw in (dict(row_stride=512), dict(batch=4)):
        with pytest.raises(ValueError, match="fp32_dscore"):
            plan.spec("bwd", torch.bfloat16, 4, 2, 128, fp32_dscore=True, **kw)


@pytest.mark.compile
@pytest.mark.parametrize("arch,cfg", [("sm_90a", ("bwd", "bfloat16", 4, 2, 512)),
                                      ("sm_90a", ("bwd_large", "bfloat16", 4, 2, 128)),
                                      ("sm_100a", ("bwd", "bfloat16", 128, 1, 512))],
                         ids=lambda c: "-".join(map(str, c)) if isinstance(c, tuple) else c)
def test_the_fp32_dscore_backward_compiles_as_the_narrow_one(arch, cfg):
    """The eager backward the adapter runs: the narrow kernel's design (copies, staging,
    CTAs an SM), no spills or local memory, and wider global stores."""
    pytest.importorskip("cutlass")
    from test_compile_cpu import probe

    narrow = probe(arch, (*cfg, 0, 0, "eager"))
    wide = probe(arch, (*cfg, 0, 0, "eager", "", 1))
    assert wide["local"] == 0 and all(s == 0 for s in wide["spills"] + wide["stack"]), wide
    for key in ("coop", "async_copies_by_bytes", "target_ctas", "grid_ctas", "smem_asked",
                "pdl_wait_first", "vec", "chunk_slots"):
        assert wide[key] == narrow[key], (key, wide[key], narrow[key])

    def stored(info):
        return sum(int(b) * n for b, n in info["stores_by_bytes"].items())

    assert stored(wide) > stored(narrow), (wide["stores_by_bytes"], narrow["stores_by_bytes"])
