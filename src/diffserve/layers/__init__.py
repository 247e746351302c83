"""Building blocks shared by the native models: CustomOp dispatch, norms, rotary, attention."""
