"""upsample_conv2d's form on CUDA (convkernels/backends/cuda_upsample.py), decided on the host:
`auto` by the input's size, a forced form as given, a misspelt one refused where the options are
made, and the service setting reaching the backend's options. Runs everywhere; test_ops_conv.py
runs both forms on a GPU against torch."""
from __future__ import annotations

import pytest

from convkernels.backends.cuda_options import CudaOptions
from convkernels.backends.cuda_upsample import PHASES_MIN_POSITIONS, form_for
from service.settings import Settings


def test_auto_takes_the_phase_form_from_the_measured_size_up():
    edge = PHASES_MIN_POSITIONS
    assert form_for("auto", (1, 64, 64, 512)) == "transposed"      # SD-VAE 512's first upsampler
    assert form_for("auto", (1, 256, 256, 256)) == "phases"        # its last
    assert form_for("auto", (1, edge - 1, 1, 8)) == "transposed"
    assert form_for("auto", (1, edge, 1, 8)) == "phases"
    assert form_for("auto", (4, 88, 160, 1024)) == "phases"        # Wan 2.2 720p, a run of 4 frames
    assert form_for("auto", (edge // 16, 4, 4, 3)) == "phases"     # frames count as positions too


@pytest.mark.parametrize("form", ["phases", "transposed"])
def test_a_forced_form_is_taken_at_every_size(form):
    assert form_for(form, (1, 1, 1, 3)) == form
    assert form_for(form, (8, 512, 512, 64)) == form


def test_a_misspelt_form_is_refused_and_the_setting_reaches_the_backend(monkeypatch):
    assert CudaOptions().upsample_form == "auto"
    with pytest.raises(ValueError, match="upsample_form must be one of"):
        CudaOptions(upsample_form="phase")
    monkeypatch.setenv("CONVSERVE_CUDA_UPSAMPLE_FORM", "transposed")
    options = Settings().backend_options()["cuda_options"]
    assert options["upsample_form"] == "transposed"
    assert CudaOptions(**options).upsample_form == "transposed"
