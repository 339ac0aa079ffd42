"""The DeepSpeed runtime path: config.py generates the DeepSpeed JSON from the spec and the plan;
engine.py implements the Engine protocol on deepspeed.initialize (``build_deepspeed_engine``)."""
