"""INT8 by calibration: recorded real inputs, Q/DQ graphs, validation against fp32."""
