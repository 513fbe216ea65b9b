"""`tigon webui`: start, watch, compare and try fine-tuning runs from a browser (Gradio).

Training runs are processes of the `tigon` command line (`tigon sft`, `tigon rlhf`), one output
directory each under ``--runs``; the UI adds no training path of its own. `tigon.webui.runs`
starts, reads and stops them (no gradio needed); `tigon.webui.app` lays them out in Gradio
(install with ``pip install 'tigon[webui]'``).
"""
