"""A front end's routes, one module per protocol, all over the one request path
(service/frontend/pipeline.py): REST /v1 (routes_v1.py), streamed video decode (streaming.py),
KServe v2 (kserve.py) and Triton's extensions (triton_extensions.py), diffusers' remote VAE
(remote_vae.py, its pixels: vae_pixels.py), the API's own docs (api_docs.py); what they share
(adapters.py) and the optional bearer-token check (auth.py)."""
