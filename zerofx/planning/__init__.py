"""Planning at scale without the hardware: ``zerofx.plan`` predicts what one rank of a world of any size holds and
sends (`predict`), for models built from a table of shapes (`shapes`, `decoder`); ``python -m zerofx plan`` prints
it per stage (`cli`)."""

from zerofx.planning.predict import plan
from zerofx.planning.shapes import KNOWN, ModelShape, from_hf_config, gpt_of_size, model_shape

__all__ = ["plan", "ModelShape", "KNOWN", "model_shape", "gpt_of_size", "from_hf_config"]
