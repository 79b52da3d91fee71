"""What every gRPC service shares: server bootstrap, health, reflection, shutdown, logging, config."""
