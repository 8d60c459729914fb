"""Task datasets: TFDS builders (array_record, no TensorFlow) and grain pipelines."""
