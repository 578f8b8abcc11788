"""The tdbg wire, sans-IO, stdlib + msgpack only: the only code that knows byte layouts."""
