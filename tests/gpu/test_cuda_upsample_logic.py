"""upsample_conv2d's form on CUDA (convkernels/backends/cuda/upsample.py), decided on the host:
`auto` by the input's size, a forced form as given, a misspelt one refused where the options are
made, and the service setting reaching the backend's options. Runs everywhere; test_ops_conv.py
runs both forms on a GPU against torch."""
from __future__ import annotations

import pytest

from convkernels.backends.cuda.options import CudaOptions
from convkernels.backends.cuda.upsample import (PHASES_MIN_CHANNELS, PHASES_MIN_POSITIONS,
                                                PHASES_NARROW_POSITIONS, form_for)
from service.settings import Settings


def test_auto_takes_the_phase_form_where_it_measured_faster():
    # the upsamplers benchmarks/gpu/upsample_forms.py timed on an H100, each on its measured side
    assert form_for("auto", (1, 64, 64, 512)) == "transposed"      # SD-VAE 512's first: 0.92-0.95x
    assert form_for("auto", (1, 128, 128, 512)) == "phases"        # its second: 1.18-1.19x
    assert form_for("auto", (1, 256, 256, 256)) == "phases"        # its last: 1.07-1.19x
    assert form_for("auto", (1, 128, 128, 64)) == "transposed"     # TAESD's first: 0.72-0.75x
    assert form_for("auto", (1, 256, 256, 64)) == "transposed"     # its second: 0.92-0.96x
    assert form_for("auto", (1, 512, 512, 64)) == "phases"         # its last: 1.12-1.15x
    assert form_for("auto", (4, 88, 160, 1024)) == "phases"        # Wan 2.2 720p, 4 frames: 1.53-1.61x
    assert form_for("auto", (4, 120, 208, 384)) == "phases"        # Wan 2.1 480p, 4 frames: 1.21-1.22x


def test_auto_edges():
    edge, narrow, wide = PHASES_MIN_POSITIONS, PHASES_NARROW_POSITIONS, PHASES_MIN_CHANNELS
    assert form_for("auto", (1, edge - 1, 1, wide)) == "transposed"
    assert form_for("auto", (1, edge, 1, wide)) == "phases"
    assert form_for("auto", (1, edge, 1, wide - 1)) == "transposed"
    assert form_for("auto", (1, narrow - 1, 1, 3)) == "transposed"
    assert form_for("auto", (1, narrow, 1, 3)) == "phases"
    assert form_for("auto", (edge // 16, 4, 4, wide)) == "phases"  # frames count as positions too


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
