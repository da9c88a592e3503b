"""Models from the Hugging Face hub: references (`refs`), the local cache (`cache`), downloads (`pull`)."""
