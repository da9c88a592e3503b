"""`localgen serve`: the OpenAI-compatible HTTP API over one shared engine (EngineService).

``app`` builds the FastAPI routes; ``protocol`` holds the request models and their conversion to
engine requests; ``responses`` shapes OpenAI's response objects; ``errors`` OpenAI's error object;
``tools`` tool calling; ``metrics`` the Prometheus exposition.
"""
