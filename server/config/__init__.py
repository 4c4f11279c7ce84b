"""Settings and model configuration: every flag's one declaration, config.pbtxt and load parameters, and the generated reference tables."""
