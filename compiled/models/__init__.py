"""The model families kiln runs, as plain nn.Modules."""
