"""One backend per `tf.distribute` strategy: `tfdist.backends.base.Backend`
is the protocol, `tfdist.backends.registry.backend_for` finds a kind's."""
