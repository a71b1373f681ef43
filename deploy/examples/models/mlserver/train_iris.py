"""Trains the scikit-learn model of deploy/examples/models/mlserver-iris.toml and writes it with
joblib: `python train_iris.py OUT.joblib`. The iris data ships inside scikit-learn, so nothing
is downloaded; the same seed gives the same model."""

import sys

import joblib
from sklearn.datasets import load_iris
from sklearn.linear_model import LogisticRegression

features, labels = load_iris(return_X_y=True)
model = LogisticRegression(max_iter=500, random_state=0).fit(features, labels)
joblib.dump(model, sys.argv[1])
print(f"trained on {len(labels)} samples, accuracy {model.score(features, labels):.3f}: {sys.argv[1]}")
