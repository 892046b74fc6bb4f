"""The brokers fedmq starts and configures, apart from the bus that talks to any broker: the embedded
broker (amqtt), mosquitto (started, bridged between sites), and a secure federation's provisioning
(its CA, certificates, passwords and ACL)."""
