"""What ``deltaserve serve`` runs, one module per engine: parse and check every flag, build the
host, start the server.

* :mod:`.serve_native`: the OpenAI-compatible application of :mod:`deltaserve.server` on the
  embedded engine (``deltaserve serve [MODEL]``);
* :mod:`.serve_vllm`: vLLM's own server, with the fine-tuning service mounted by the
  ``vllm.endpoint_plugins`` entry point (:mod:`deltaserve.server.vllm_plugin`), or one dataset
  trained for its lifetime (``deltaserve serve --engine vllm``);
* :mod:`.serve_sglang`: SGLang's own server with DeltaServe's scheduler in its scheduler process
  (``deltaserve serve --engine sglang``).

The top layer below :mod:`deltaserve.cli`: it imports the server and the hosts, and only the
command line imports it. The vLLM and SGLang modules import their engine, so the command line
imports each only when ``--engine`` names it.
"""
