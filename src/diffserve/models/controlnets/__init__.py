"""models/controlnets: ControlNets, native, loading Diffusers weights unchanged."""
