"""The built-in actions of the controller, one module per family."""
