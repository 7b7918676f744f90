// Empty: the emulator puts its own version of MLX's utilities before every kernel.
